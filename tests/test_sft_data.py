"""SFT from data rows (``sft.data`` / ``molt sft --data``): the row forms, the exact loss mask
on hand-made rows, prompts rendered as the engine renders them, and weights that move."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from molt_core.ledger import Ledger
from molt_core.models import load_model, load_tokenizer
from molt_core.train.sft import collate, examples_from_rows, render_example

U = {"role": "user", "content": "What is 1 + 2?"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def test_examples_from_rows_every_form():
    chat = [{"role": "system", "content": "s"}, U, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "and 3 + 4?"}, {"role": "assistant", "content": "7"}]
    rows = [
        {"prompt": "What is 1 + 2?", "completion": "3"},
        {"prompt": [U], "completion": [{"role": "assistant", "content": "3"}]},  # TRL conversational
        {"messages": chat},
    ]
    assert examples_from_rows(rows) == [
        ([U], "3"),
        ([U], "3"),
        (chat[:2], "3"),  # one example per assistant turn, prompt = the messages before it
        (chat[:4], "7"),
    ]


@pytest.mark.parametrize("row, msg", [
    ({"text": "x"}, r"sft.data: row 1 has fields \['text'\]; an SFT row needs 'prompt' and 'completion', or 'messages'"),
    ({"messages": [U]}, "row 1 has no assistant message after a prompt"),
    ({"messages": [{"role": "user"}]}, r"row 1 'messages' must be a list of \{\"role\": str, \"content\": str\}"),
    ({"prompt": "a", "completion": [{"role": "user", "content": "b"}]}, "row 1 'completion' must be one assistant message"),
    ({"prompt": "a", "completion": 3}, "row 1: 'completion' must be a string"),
])
def test_examples_from_rows_errors(row, msg):
    with pytest.raises(ValueError, match=msg):
        examples_from_rows([row])


def test_exact_mask_on_a_hand_made_row(tok):
    """Prompt tokens are the engine's prompt ids; labels are -100 on every prompt and padding
    position and the completion ids (reply digits, then <|im_end|> = 2) elsewhere."""
    (ex,) = examples_from_rows([{"prompt": "What is 1 + 2?", "completion": "13"}])
    p, c = render_example(tok, *ex)
    assert p == Ledger(tok).prepare([U]).prompt_ids  # tokenized exactly as the engine renders the prompt
    assert tok.decode(p) == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    one, three = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("3")
    assert c == [one, three, 2]
    short = (p[:3], [three, 2])  # a second, shorter row: padded
    ids, labels = collate([(p, c), short], pad_id=0)
    T = len(p) + 3
    assert ids.shape == labels.shape == (2, T) and ids.dtype == labels.dtype == torch.long
    assert ids[0].tolist() == p + c
    assert ids[1].tolist() == p[:3] + [three, 2] + [0] * (T - 5)
    assert labels[0].tolist() == [-100] * len(p) + [one, three, 2]
    assert labels[1].tolist() == [-100, -100, -100, three, 2] + [-100] * (T - 5)


def test_second_assistant_turn_masks_the_first(tok):
    chat = [U, {"role": "assistant", "content": "3"}, {"role": "user", "content": "4 + 4?"},
            {"role": "assistant", "content": "8"}]
    ex = examples_from_rows([{"messages": chat}])
    p, c = render_example(tok, *ex[1])
    assert tok.decode(p).endswith("<|im_start|>assistant\n3<|im_end|>\n<|im_start|>user\n4 + 4?<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert c == [tok.convert_tokens_to_ids("8"), 2]


def test_molt_sft_data_moves_weights(tmp_path):
    """`molt sft RECIPE --data rows.jsonl`, with no agent in the recipe: every step has a
    gradient, and the saved weights differ from the seed-0 init they started from."""
    from molt_core.cli import main

    rows = [{"prompt": f"What is {a} + {b}?", "completion": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 5), (2, 7)]]
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.toml"
    recipe.write_text("[run]\nseed = 0\n[sft]\nsteps = 3\nbatch_size = 5\nlr = 1e-3\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["sft", str(recipe), "--data", str(data), "--out", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert all(x["sft/grad_norm"] > 0 for x in lines)
    # 5 rows -> 5 completions: "3","7","10","9" (1 + 1 + 2 + 1 digits) and "hello" (tokens of it), each + <|im_end|>
    tok = load_tokenizer("builtin:tiny-qwen3")
    n_tok = (1 + 1 + 2 + 1) + 4 + (len(tok.encode("hello", add_special_tokens=False)) + 1)
    assert lines[0]["sft/tokens"] == n_tok
    assert f'data = "{data}"' in (out / "config.toml").read_text()
    init = load_model("builtin:tiny-qwen3", seed=0).state_dict()
    after = load_model(str(out / "model")).state_dict()
    moved = [k for k in init if not torch.equal(init[k], after[k])]
    assert len(moved) == len(init)  # every tensor got an AdamW step


def test_molt_sft_data_bad_row_is_a_usage_error(tmp_path):
    from molt_core.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"text": "c"}\n')
    recipe = tmp_path / "r.toml"
    recipe.write_text("[sft]\nsteps = 1\n")
    res = CliRunner().invoke(main, ["sft", str(recipe), "--data", str(data), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "sft.data: row 2 has fields ['text']" in res.output
