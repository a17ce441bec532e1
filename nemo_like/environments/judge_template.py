"""The judge's prompt template: inline or from a file, a Python format string or a Jinja template.

Fields: ``prompt`` (the policy's prompt, "" when the sample carries none), ``response`` (the policy's response),
``answer`` (``metadata["answer"]``, "" when absent) and ``metadata`` (the sample's metadata dict, e.g.
``{metadata[task_name]}`` / ``{{ metadata.task_name }}``). A template naming any other field is an error at start-up.
"""

from __future__ import annotations

import _string
import string
from pathlib import Path
from typing import Any, Literal

#: The fields a judge template may use.
TEMPLATE_FIELDS = ("prompt", "response", "answer", "metadata")
#: The template used when the section gives none.
DEFAULT_TEMPLATE = "Question: {prompt}\nResponse: {response}\nRate the response from 0 to 10. Score:"
DEFAULT_SCORE_RANGE = (0.0, 10.0)  # the scale DEFAULT_TEMPLATE asks for

TemplateFormat = Literal["format", "jinja"]


def load_template_text(template: str | None, template_file: str | None) -> str:
    """The template's text: ``template`` inline, the contents of ``template_file``, or :data:`DEFAULT_TEMPLATE`.

    Raises:
        ValueError: both given, or the file is missing or unreadable."""
    if template is not None and template_file is not None:
        raise ValueError("set either template (inline) or template_file, not both")
    if template_file is None:
        return DEFAULT_TEMPLATE if template is None else template
    path = Path(template_file).expanduser()
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"template_file {template_file!r} cannot be read: {exc}") from None


def template_fields(text: str, fmt: TemplateFormat) -> set[str]:
    """The top-level names ``text`` uses (``metadata`` for ``{metadata[x]}``)."""
    if fmt == "format":
        names = set()
        for _, field, _, _ in string.Formatter().parse(text):
            if field is not None:
                if field == "" or field.isdigit():
                    raise ValueError(f"the template uses a positional field {{{field}}}; name one of {list(TEMPLATE_FIELDS)}")
                name, parts = _string.formatter_field_name_split(field)
                parts = list(parts)
                if any(is_attribute for is_attribute, _ in parts):  # every field is a string or the metadata dict
                    keys = "".join(f"[{key}]" for _, key in parts)
                    hint = f"write {{{name}{keys}}}" if name == "metadata" else f"{{{name}}} is text"
                    raise ValueError(
                        f"the template's field {{{field}}} reads an attribute, which format templates' fields do not have: "
                        f"{hint} (a dotted name is Jinja's spelling, with template_format: jinja)"
                    )
                names.add(name)
        return names
    import jinja2
    from jinja2 import meta

    try:
        return set(meta.find_undeclared_variables(jinja2.Environment().parse(text)))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the Jinja template does not parse (line {exc.lineno}): {exc.message}") from None


class JudgeTemplate:
    """A checked template; :meth:`render` fills it for one sample."""

    def __init__(self, text: str, fmt: TemplateFormat = "format") -> None:
        fields = template_fields(text, fmt)
        unknown = sorted(fields - set(TEMPLATE_FIELDS))
        if unknown:
            raise ValueError(f"the template uses unknown field(s) {unknown}; available: {list(TEMPLATE_FIELDS)}")
        if "response" not in fields:  # the judge scored one text for every sample: a reward constant in each group
            raise ValueError("the template never uses {response}: the judge would score the same text for every sample; add {response}")
        self.text, self.fmt = text, fmt
        self._jinja = None
        if fmt == "jinja":
            import jinja2

            self._jinja = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(text)

    def render(self, prompt: str, response: str, metadata: dict[str, Any]) -> str:
        """The judge prompt of one sample (raises ``KeyError``/``jinja2`` errors for a missing metadata key)."""
        answer = metadata.get("answer")
        fields = {"prompt": prompt, "response": response, "answer": "" if answer is None else str(answer), "metadata": metadata}
        if self._jinja is not None:
            return self._jinja.render(**fields)
        return self.text.format(**fields)
