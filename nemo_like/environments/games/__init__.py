"""Game environments with per-turn feedback (multi-turn): :mod:`.guess_number`."""
