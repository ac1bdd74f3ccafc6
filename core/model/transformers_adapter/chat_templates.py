"""Chat templates as transformers compiles them: its own Jinja environment (a sandbox, its extensions such as the
``{% generation %}`` tag), so that a template it would refuse at the first row is refused before any model loads.
``_compile_jinja_template`` is transformers' private compiler (``transformers.utils.chat_template_utils``, 4.55 and
5.x), cached by the template's text: compiling here costs nothing when the rows are rendered."""

from __future__ import annotations


def template_syntax_problem(template: str) -> str | None:
    """Where and why ``template`` is not a Jinja template transformers can compile ("line 3 is not valid Jinja
    (unexpected '}')"), or None when it compiles (or when this release cannot tell: the first row then says why)."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as error:
        return f"line {error.lineno} is not valid Jinja ({error.message})"
    except Exception:  # noqa: BLE001 - jinja2 missing or too old: said when a row is rendered
        return None
    return None
