"""Build the tiny ChatML byte-level BPE tokenizer the project ships (``assets/tiny_chatml``).

No model hub is reachable, so the project trains its own tokenizer for the builtin tiny
Qwen3-architecture models. Run ``python -m molt_core.assets.build_tiny_tokenizer`` to
regenerate ``tiny_chatml/tokenizer.json`` and ``tiny_chatml/tokenizer_config.json``; the
output is byte-for-byte deterministic (fixed corpus seed, single-threaded trainer).

Design:
  * byte-level BPE (GPT-2 byte alphabet, every byte string is encodable) with at most
    :data:`VOCAB_SIZE` = 512 entries, special and added tokens included;
  * pre-tokenizer: the Qwen2 split pattern with ``\\p{N}`` matched one character at a time,
    so every ASCII digit is always its own token (arithmetic tasks see digits);
  * specials ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and the added
    tokens ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
    ``</tool_response>`` (not "special": they survive ``skip_special_tokens`` decoding);
  * a Qwen3-style ChatML chat template written for this project (:data:`CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "VL_CHAT_TEMPLATE", "VISION_TOKENS", "SPECIAL_TOKENS", "ADDED_TOKENS", "VOCAB_SIZE", "SPLIT_PATTERN", "corpus", "build"]

OUT_DIR = Path(__file__).resolve().parent / "tiny_chatml"
VOCAB_SIZE = 512
#: (content, special) in id order: ids 0..8.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
#: Qwen2's pre-tokenizer regex (digits already one per match via ``\p{N}``).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Our own Jinja ChatML template in the Qwen3 style. Rendering rules:
#   * every message is "<|im_start|>{role}\n{content}<|im_end|>\n";
#   * ``tools`` given: the system turn (created if absent) ends with a "# Tools" section that
#     lists one JSON signature per line inside <tools></tools>;
#   * assistant ``tool_calls`` -> "<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>",
#     one per call, separated from preceding text by "\n";
#   * ``role: tool`` messages -> one user turn per run of consecutive tool messages, each as
#     "<tool_response>\n...\n</tool_response>", joined by "\n";
#   * an assistant turn before the last user message loses its <think>...</think> block (Qwen3
#     history rewriting, ledger case B03); later assistant turns keep their content verbatim;
#     a separate ``reasoning_content`` is rendered as "<think>\n{r}\n</think>\n\n" on kept turns;
#   * ``add_generation_prompt`` appends "<|im_start|>assistant\n", and with
#     ``enable_thinking=false`` also an empty "<think>\n\n</think>\n\n" block.
CHAT_TEMPLATE = (
    "{%- macro text_of(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable -%}{%- for part in c -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}\n"
    "{%- set ns = namespace(last_user=-1) -%}\n"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}\n"
    "{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}\n"
    "{%- if tools or has_system -%}\n"
    "  {{- '<|im_start|>system\\n' -}}\n"
    "  {%- if has_system -%}{{- text_of(messages[0].content) -}}{%- endif -%}\n"
    "  {%- if tools -%}\n"
    "    {%- if has_system -%}{{- '\\n\\n' -}}{%- endif -%}\n"
    "    {{- '# Tools\\n\\nYou can call the functions described below. Each signature is a JSON object '\n"
    "        'inside <tools></tools>:\\n<tools>' -}}\n"
    "    {%- for t in tools -%}{{- '\\n' -}}{{- t | tojson -}}{%- endfor -%}\n"
    "    {{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and arguments '\n"
    "        'inside <tool_call></tool_call> tags:\\n<tool_call>\\n'\n"
    "        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' -}}\n"
    "  {%- endif -%}\n"
    "  {{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for m in messages -%}\n"
    "  {%- if loop.first and m.role == 'system' -%}\n"
    "  {%- elif m.role == 'assistant' -%}\n"
    "    {%- set body = text_of(m.content) -%}\n"
    "    {%- if '</think>' in body -%}\n"
    "      {%- if loop.index0 < ns.last_user -%}{%- set body = body.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}\n"
    "    {%- elif m.reasoning_content is string and loop.index0 > ns.last_user -%}\n"
    "      {%- set body = '<think>\\n' ~ m.reasoning_content.strip('\\n') ~ '\\n</think>\\n\\n' ~ body.lstrip('\\n') -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<|im_start|>assistant\\n' ~ body -}}\n"
    "    {%- for call in (m.tool_calls or []) -%}\n"
    "      {%- set fn = call.function if call.function is defined else call -%}\n"
    "      {%- if body or not loop.first -%}{{- '\\n' -}}{%- endif -%}\n"
    "      {{- '<tool_call>\\n{\"name\": \"' ~ fn.name ~ '\", \"arguments\": ' -}}\n"
    "      {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}\n"
    "      {{- '}\\n</tool_call>' -}}\n"
    "    {%- endfor -%}\n"
    "    {{- '<|im_end|>\\n' -}}\n"
    "  {%- elif m.role == 'tool' -%}\n"
    "    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user\\n' -}}\n"
    "    {%- else -%}{{- '\\n' -}}{%- endif -%}\n"
    "    {{- '<tool_response>\\n' ~ text_of(m.content) ~ '\\n</tool_response>' -}}\n"
    "    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}\n"
    "  {%- else -%}\n"
    "    {{- '<|im_start|>' ~ m.role ~ '\\n' ~ text_of(m.content) ~ '<|im_end|>\\n' -}}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}\n"
    "{%- endif -%}\n"
)

#: The vision special tokens of the Qwen2-VL family, appended after the 512 entries for the
#: builtin vision-language model (ids 512..515).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_TEXT_PART = "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
# :data:`CHAT_TEMPLATE` whose content parts may also be images: an image part (``type`` ``image``,
# ``image_url`` or ``input_image``) renders as ``<|vision_start|><|image_pad|><|vision_end|>`` --
# one placeholder per image, which :func:`molt_plugins.vision.processor.expand_placeholders` expands into
# the image processor's run (as Qwen2-VL's own template and processor do).
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_PART, (
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ('image', 'image_url', 'input_image') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
), 1)
if VL_CHAT_TEMPLATE == CHAT_TEMPLATE:  # the text-part branch moved: update _TEXT_PART
    raise RuntimeError("VL_CHAT_TEMPLATE: CHAT_TEMPLATE's text-part branch was not found")

_WORDS = (
    "the a an of to and in is it that for on with as was be by this are or from at have not "
    "but what all were when we there can your which their if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much before go good new "
    "write our used me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet "
    "answer question result sum total plus minus times add subtract multiply divide equals value "
    "compute calculate function call tool search weather city temperature file open list get "
    "user assistant system reasoning step first second then finally therefore so let check"
).split()
_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Paris", "London", "Tokyo", "Berlin", "Rome"]
_TOOLS = ["get_weather", "calculator", "search", "read_file", "add", "multiply", "lookup"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    s = " ".join(words)
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ","])


def _arith(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice(["+", "-", "*"])
    ans = {"+": a + b, "-": a - b, "*": a * b}[op]
    q = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?"])
    return q, str(ans)


def corpus(n: int = 6000, seed: int = 0) -> list[str]:
    """The deterministic training corpus: ``n`` documents (list of str) from ``seed``.

    Mixes English-like sentences, arithmetic questions and answers, and ChatML chat turns with
    tool calls (JSON), tool responses and think blocks, rendered in the template's format.
    """
    rng = random.Random(seed)
    docs: list[str] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            docs.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))))
        elif kind == 1:
            q, a = _arith(rng)
            docs.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n"
                        f"{_sentence(rng)}\n</think>\n\nThe answer is {a}.<|im_end|>\n")
        elif kind == 2:
            tool = rng.choice(_TOOLS)
            args = {"city": rng.choice(_NAMES)} if rng.random() < 0.5 else {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}
            call = json.dumps({"name": tool, "arguments": args})
            result = json.dumps({"result": rng.randint(-50, 500), "unit": rng.choice(["C", "F", "ok"])})
            docs.append(f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
                        f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n")
        else:
            schema = {"type": "function", "function": {"name": rng.choice(_TOOLS), "description": _sentence(rng),
                      "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
            docs.append(f"<|im_start|>system\n{_sentence(rng)}\n<tools>\n{json.dumps(schema)}\n</tools><|im_end|>\n")
    return docs


def build(out_dir: Path = OUT_DIR) -> Path:
    """Train the tokenizer on :func:`corpus` and write ``tokenizer.json`` and
    ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE`) into ``out_dir``. Returns ``out_dir``.

    Raises:
        RuntimeError: if the trained vocabulary exceeds :data:`VOCAB_SIZE` or a digit is not
            a single token.
    """
    os.environ["RAYON_NUM_THREADS"] = "1"  # the BPE trainer then counts and merges in one order
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    specials = SPECIAL_TOKENS + ADDED_TOKENS
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # the specials are atomic in the corpus (never merged into or across)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ADDED_TOKENS])
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"vocab has {tok.get_vocab_size()} entries, more than {VOCAB_SIZE}")
    for d in "0123456789":
        if len(tok.encode(d * 5).ids) != 5:
            raise RuntimeError(f"digit {d!r} repeated is not one token per digit")
    for i, s in enumerate(specials):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"{s} has id {tok.token_to_id(s)}, expected {i}")

    # the trainer registers every token it is given as "special"; <think>, <tool_call>, ... are
    # plain added tokens (kept by skip_special_tokens decoding, as in Qwen3)
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": s in SPECIAL_TOKENS} for i, s in enumerate(specials)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out_dir


if __name__ == "__main__":
    print(build())
