"""A chat template that writes harmony (gpt-oss's format), for tests whose tokenizer is SmolLM2's with
the harmony markers added as special tokens: it renders tools by name, and ends the generation
prompt with `<|start|>assistant` as gpt-oss's does."""

HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools{% for tool in tools %} {{ tool.function.name }}"
    "{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)
