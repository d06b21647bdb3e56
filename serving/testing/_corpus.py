"""The built-in text the test tokenizer is trained on.

A few KB covering what the serving stack has to tokenize in tests: English
prose, chat markup, JSON and tool calls, Python, numbers, and non-ASCII text
(accented Latin, CJK, emoji) so that some characters only exist as byte
sequences split over several tokens. Changing this text changes every generated
checkpoint: bump ``GENERATOR_VERSION`` in ``checkpoint.py`` when you do.
"""

CORPUS = r"""
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Kubernetes is an open-source system for automating deployment, scaling, and management of containerized
applications. It groups containers that make up an application into logical units for easy management
and discovery. A model server loads the weights of a language model into memory, waits for requests,
and streams tokens back to the client as soon as they are generated.

Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter. Every
morning they walked down to the harbor, mended their nets, and talked about the weather. The daughter
wanted to become a sailor and see the world; the father wanted her to stay and keep the house. One
day a storm came from the north, and the boats could not leave the harbor for a whole week. They read
books, cooked soup, and told each other stories about distant islands, strange animals, and brave
captains who crossed the ocean with nothing but a compass and a map.

Hello! How can I help you today? I would like to know the weather in Paris, please. Sure, let me check
that for you. The weather in Paris is sunny with a high of 24 degrees Celsius and a light wind from the
west. Thank you very much! You're welcome. Is there anything else I can do for you? What time is it in
Tokyo? It is currently 9:30 in the evening in Tokyo. Can you write a short poem about the moon?

The moon is bright, the night is long,
the river hums an ancient song.
We count the stars, we lose our way,
and wait together for the day.

Large language models are trained to predict the next token in a sequence of text. A tokenizer splits
text into tokens, which are mapped to integer ids. Byte-level BPE starts from the 256 possible byte
values and repeatedly merges the most frequent pair of adjacent symbols. Because every byte is in the
vocabulary, any string can be encoded, even text in languages or scripts that never appeared during
training. Attention lets each position look at every earlier position; the key and value vectors are
kept in a cache so that generating the next token does not recompute the whole prompt. Paged attention
stores that cache in fixed-size blocks, like pages of virtual memory, which makes batching many requests
of different lengths efficient.

<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
<|im_start|>user
Find me a flight from Berlin to Rome next Friday.<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "search_flights", "arguments": {"origin": "BER", "destination": "FCO", "date": "2024-05-17"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"flights": [{"number": "LH 1234", "departure": "08:15", "arrival": "10:20", "price": 129.99}]}
</tool_response><|im_end|>
<|im_start|>assistant
There is a Lufthansa flight LH 1234 leaving at 08:15 and arriving at 10:20 for 129.99 euros.<|im_end|>

<tool_call>
{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius"}}
</tool_call>
<tool_call>
{"name": "get_current_time", "arguments": {"timezone": "Asia/Tokyo"}}
</tool_call>
<tool_call>
{"name": "calculator", "arguments": {"expression": "(17 + 25) * 3 / 2"}}
</tool_call>

{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a given
location", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The
city and state, e.g. San Francisco, CA"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
"required": ["location"]}}}
{"id": "chatcmpl-123", "object": "chat.completion", "created": 1700000000, "model": "llmkube-demo",
"choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "call_abc",
"type": "function", "function": {"name": "get_weather", "arguments": "{\"location\": \"Boston\"}"}}]},
"finish_reason": "tool_calls", "logprobs": null}], "usage": {"prompt_tokens": 42, "completion_tokens": 17,
"total_tokens": 59}}
{"name": "Alice", "age": 30, "email": "alice@example.com", "tags": ["admin", "user"], "active": true}
{"name": "Bob", "age": 25, "email": "bob@example.org", "tags": [], "active": false, "score": -3.5e-2}
[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]

def fibonacci(n: int) -> list[int]:
    '''Return the first n Fibonacci numbers.'''
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Request:
    def __init__(self, request_id: str, prompt: str, max_tokens: int = 16) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output_tokens: list[int] = []

    def is_finished(self) -> bool:
        return len(self.output_tokens) >= self.max_tokens


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import json
with open("config.json") as f:
    config = json.load(f)
print(config["hidden_size"], config.get("num_key_value_heads", 8))

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2);
SELECT id, name FROM users WHERE age > 21 ORDER BY name;
kubectl apply -f model.yaml && kubectl get pods -n llmkube
curl -X POST http://localhost:8000/v1/chat/completions -H "Content-Type: application/json"

Le café est très bon ce matin. Nous avons mangé une crème brûlée à la pâtisserie près de l'église.
Ein naïver Ansatz führt hier zu Größenproblemen; die Straße ist über die Brücke erreichbar.
El niño comió paella en la playa. ¿Dónde está la estación? ¡Qué día tan bonito!
Москва — столица России. Привет, как дела? Спасибо, хорошо.
日本語のテキストも少し含めます。東京は日本の首都です。こんにちは、世界！
中文也是一种常见的语言。你好，世界。今天天气很好。
한국어 문장도 있습니다. 안녕하세요.
Emoji: 😀 🚀 🎉 👍 ❤️ 🌍 🤖 ✨ — résumé, jalapeño, São Paulo, Zürich, Ångström, façade, coöperate.
Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14159, 10 µs, 25 °C, 100 €, £50, ¥1000.

The engine keeps a queue of waiting requests and a list of running ones. At every step the scheduler
picks which requests run, how many prompt tokens each may prefill, and which blocks of the cache they
use. When the cache is full, the newest request is preempted: its blocks are freed, and it goes back to
the front of the queue to be recomputed later. Sampling turns the logits of the last position into the
next token: temperature divides the logits, top-k keeps the k largest, top-p keeps the smallest set
whose probability reaches p, and a seeded generator makes the choice reproducible.

Error: model not found. Warning: the request was too long and has been truncated. Status: Ready.
Question: Why is the sky blue? Answer: Sunlight is scattered by the molecules of the air, and blue light
is scattered more than red light because it has a shorter wavelength.
"""
