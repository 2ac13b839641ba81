"""A chat_template_kwargs variable the template never reads is refused naming it, not dropped;
one it reads passes, and enable_thinking passes where it turns the gateway's reasoning split off."""

from __future__ import annotations

import pytest

from gateway_service.chat_format import ChatFormat, template_kwargs, template_variables
from gateway_service.errors import InvalidRequest

# The shape of a template with a thinking switch (Qwen3's reads enable_thinking this way).
THINKING = ("{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}"
            "{%- if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
            " <think></think>{% endif %}{% endif %}")


def test_the_variables_a_template_reads() -> None:
    assert template_variables(THINKING) == {"messages", "add_generation_prompt", "enable_thinking"}
    assert template_variables("{% set y = 1 %}{{ y }}") == frozenset()  # its own variables are not the caller's
    assert template_variables("{% if %}") is None  # unreadable here: no variable is refused


def test_a_variable_the_template_does_not_read_is_refused_naming_it() -> None:
    reads = template_variables(THINKING)
    assert template_kwargs('{"enable_thinking": false}', reads) == {"enable_thinking": False}
    with pytest.raises(InvalidRequest, match=r"chat_template_kwargs.thinking_budget: this model's chat template "
                                             r"does not read it, .*\(it reads enable_thinking\)"):
        template_kwargs('{"enable_thinking": false, "thinking_budget": 5}', reads)
    assert template_kwargs('{"anything": 1}', None) == {"anything": 1}


def test_enable_thinking_is_read_where_the_gateway_splits_reasoning(tokenizer) -> None:
    plain = ChatFormat.detect(tokenizer, "auto", "none")
    assert plain.template_reads == {"messages", "add_generation_prompt"}  # SmolLM2's template
    with pytest.raises(InvalidRequest, match="enable_thinking"):
        template_kwargs('{"enable_thinking": false}', plain.template_reads)
    split = ChatFormat.detect(tokenizer, "auto", "think")
    assert template_kwargs('{"enable_thinking": false}', split.template_reads) == {"enable_thinking": False}
