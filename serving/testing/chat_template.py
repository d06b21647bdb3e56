"""The ChatML chat template (Qwen2.5 style, with tools) that generated checkpoints carry.

It only uses what both Hugging Face's ``apply_chat_template`` and a plain
``jinja2`` sandbox with a ``tojson`` filter and a ``raise_exception`` global
provide, so our own renderer and ``transformers`` produce the same prompt.

Supported input, as in the OpenAI chat API:

* ``content`` as a string, ``None``, or a list of ``{"type": "text", "text": ...}`` parts;
* ``tools``: listed as JSON inside ``<tools></tools>`` in the system turn;
* assistant ``tool_calls`` (``{"function": {"name", "arguments"}}`` or the bare
  ``{"name", "arguments"}``), with ``arguments`` a dict or an already-encoded JSON string;
* ``tool`` messages: consecutive ones are grouped into one user turn of
  ``<tool_response>`` blocks;
* ``add_generation_prompt``.
"""

CHATML_TOOLS_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part['type']) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system_message = render_content(messages[0]['content']) -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set system_message = none -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_message is not none -%}
        {{- system_message -}}
    {%- else -%}
        {{- 'You are a helpful assistant.' -}}
    {%- endif -%}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}
        {{- tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif system_message is not none -%}
    {{- '<|im_start|>system\n' + system_message + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = message['role'] -%}
    {%- if role == 'user' or role == 'system' -%}
        {{- '<|im_start|>' + role + '\n' + render_content(message['content']) + '<|im_end|>\n' -}}
    {%- elif role == 'assistant' -%}
        {{- '<|im_start|>assistant' -}}
        {%- set text = render_content(message['content']) -%}
        {%- if text -%}
            {{- '\n' + text -}}
        {%- endif -%}
        {%- if message['tool_calls'] is defined and message['tool_calls'] -%}
            {%- for tool_call in message['tool_calls'] -%}
                {%- if tool_call['function'] is defined -%}
                    {%- set call = tool_call['function'] -%}
                {%- else -%}
                    {%- set call = tool_call -%}
                {%- endif -%}
                {{- '\n<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' -}}
                {%- if call['arguments'] is string -%}
                    {{- call['arguments'] -}}
                {%- else -%}
                    {{- call['arguments'] | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif role == 'tool' -%}
        {%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message['content']) + '\n</tool_response>' -}}
        {%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' ~ role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
