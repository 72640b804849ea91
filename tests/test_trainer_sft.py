"""SFT warm start: chat-template rendering (only completion tokens in the loss), the loss
falls on a tiny task, micro-batch invariance, label noise, and `molt sft`."""

from __future__ import annotations

import copy
import json
import random
import textwrap

import pytest
import torch
from click.testing import CliRunner

from molt_core.agents import Env
from molt_core.models import load_model, load_tokenizer
from molt_core.train.sft import examples_from_agent, noisy_answer, render_example, sft
from molt_core.train import Trainer
from molt_core.types import Result
from trainer_utils import tiny_cfg


@pytest.fixture(scope="module")
def base():
    return load_model("builtin:tiny-qwen3", seed=0), load_tokenizer("builtin:tiny-qwen3")


def add_examples(n: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        out.append(([{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b)))
    return out


def test_render_example_matches_ledger_and_engine_stop(base):
    from molt_core.ledger import Ledger

    _, tok = base
    msgs = [{"role": "user", "content": "What is 12 + 34?"}]
    p, c = render_example(tok, msgs, "46")
    assert p == Ledger(tok).prepare(msgs).prompt_ids  # what the engine is given
    # the reply "46" is digits one per token, then <|im_end|> (id 2); the "\n" after it is not
    assert c == tok.encode("46", add_special_tokens=False) + [2]
    assert len(c) == 3 and tok.decode(c) == "46<|im_end|>"


def test_sft_loss_falls_on_tiny_task(base):
    model, tok = base
    tr = Trainer(tiny_cfg(trainer={"micro_batch_size": 16}), model=copy.deepcopy(model), tokenizer=tok)
    ex = add_examples(16)
    losses = sft(tr, ex, steps=40, batch_size=16, lr=3e-3, seed=0)
    assert len(losses) == 40
    # random init: ~ln(512) = 6.24 nats per completion token
    assert losses[0] == pytest.approx(6.24, abs=0.3)
    assert losses[-1] < 0.35 * losses[0]
    assert tr.version == 0


def test_sft_micro_batch_invariance(base):
    model, tok = base
    ex = add_examples(6, seed=1)
    out = []
    for mb in (6, 4, 1):
        tr = Trainer(tiny_cfg(trainer={"micro_batch_size": mb}), model=copy.deepcopy(model), tokenizer=tok)
        out.append((sft(tr, ex, steps=2, batch_size=6, lr=1e-3), copy.deepcopy(tr.model.state_dict())))
    for losses, state in out[1:]:
        assert losses == pytest.approx(out[0][0], abs=1e-6)
        for k in state:
            torch.testing.assert_close(state[k], out[0][1][k], rtol=1e-4, atol=1e-6)


class AddEnv(Env):
    system_prompt = "Answer with the number."

    def tasks(self, split, seed):
        rng = random.Random(seed)
        while True:
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            yield {"question": f"What is {a} + {b}?", "answer": str(a + b)}

    def reset(self, task):
        return task["question"]

    def step(self, action_text, state):
        return Result(reward=float(action_text.strip() == state.task["answer"]), terminated=True)


def test_examples_from_agent_and_label_noise():
    env = AddEnv()
    clean = examples_from_agent(env, 20, seed=3)
    assert clean[0][0][0] == {"role": "system", "content": "Answer with the number."}
    assert clean[0][0][1]["content"].startswith("What is ")
    noisy = examples_from_agent(env, 20, seed=3, label_noise=0.3)
    wrong = [i for i in range(20) if noisy[i][1] != clean[i][1]]
    assert len(wrong) == 6  # round(0.3 * 20)
    assert all(1 <= abs(int(noisy[i][1]) - int(clean[i][1])) <= 10 for i in wrong)
    assert examples_from_agent(env, 20, seed=3, label_noise=0.3) == noisy  # deterministic
    assert noisy_answer("cat", random.Random(0), ["cat", "dog"]) == "dog"
    with pytest.raises(ValueError, match="only 0 tasks"):
        examples_from_agent(type("E", (AddEnv,), {"tasks": lambda s, sp, sd: iter(())})(), 1, 0)


AGENT_FILE = textwrap.dedent('''
    import random
    from molt_core.agents import Env
    from molt_core.types import Result

    class AddEnv(Env):
        def tasks(self, split, seed):
            rng = random.Random(seed)
            while True:
                a, b = rng.randint(10, 49), rng.randint(10, 49)
                yield {"question": f"What is {a} + {b}?", "answer": str(a + b)}

        def reset(self, task):
            return task["question"]

        def step(self, action_text, state):
            return Result(reward=float(action_text.strip() == state.task["answer"]), terminated=True)
''')


def test_molt_sft_command(tmp_path):
    from molt_core.cli import main

    (tmp_path / "agent.py").write_text(AGENT_FILE)
    recipe = tmp_path / "r.toml"
    recipe.write_text('[sft]\nsteps = 3\nbatch_size = 4\nn_examples = 8\nlr = 1e-3\n')
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["sft", str(recipe), "--agent", str(tmp_path / "agent.py"), "--out", str(out),
                                    "--set", "sft.label_noise=0.25"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2] and all(x["sft/loss"] > 0 for x in lines)
    assert "label_noise = 0.25" in (out / "config.toml").read_text()
    m = load_model(str(out / "model"))
    assert type(m).__name__ == "Qwen3ForCausalLM"
    assert load_tokenizer(str(out / "model")).eos_token == "<|im_end|>"
    # sft.steps = 0 is refused with a message naming the field
    res = CliRunner().invoke(main, ["sft", str(recipe), "--agent", str(tmp_path / "agent.py"), "--out", str(out),
                                    "--set", "sft.steps=0"])
    assert res.exit_code == 2 and "sft.steps" in res.output


def test_sft_lr_schedule_per_step(base):
    """sft.warmup_steps + sft.lr_schedule follow trainer.lr_factor: warmup (i+1)/w, then decay
    over the remaining steps (cosine: 0.5 (1 + cos(pi p)), p = (i - w) / (steps - w))."""
    model, tok = base
    tr = Trainer(tiny_cfg(trainer={"micro_batch_size": 4}), model=copy.deepcopy(model), tokenizer=tok)
    lrs: list[float] = []
    sft(tr, add_examples(8), steps=6, batch_size=4, lr=1e-2, seed=0, warmup_steps=2, lr_schedule="cosine",
        log=lambda i, m: lrs.append(m["sft/lr"]))
    # steps 0,1: 1e-2 * 1/2, 2/2; steps 2..5: p = 0, 1/4, 2/4, 3/4
    want = [5e-3, 1e-2, 1e-2, 1e-2 * (0.5 + 0.5 * 2 ** -0.5), 5e-3, 1e-2 * (0.5 - 0.5 * 2 ** -0.5)]
    assert lrs == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="cosine"):
        sft(tr, add_examples(8), steps=2, batch_size=4, lr=1e-2, lr_schedule="cosin")


def test_in_run_warm_start_is_molt_sft(tmp_path):
    """The warm start inside `molt run` (TrainerWorker.sft) and `molt sft` are one computation:
    same recipe -> bit-identical weights, with run.threads torch threads (not every core)."""
    from molt_core.cli import main
    from molt_core.cli.recipe import load_config
    from molt_core.runtime import TrainerWorker

    (tmp_path / "agent.py").write_text(AGENT_FILE)
    recipe = tmp_path / "r.toml"
    recipe.write_text('[run]\nthreads = 1\n[sft]\nsteps = 4\nbatch_size = 4\nn_examples = 8\nlr = 1e-3\n'
                      'warmup_steps = 1\nlr_schedule = "linear"\nlabel_noise = 0.25\n')
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["sft", str(recipe), "--agent", str(tmp_path / "agent.py"), "--out", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    cfg = load_config(recipe, [f"agent.path={tmp_path / 'agent.py'}"])
    worker = TrainerWorker(cfg)
    m = worker.sft()
    assert torch.get_num_threads() == 1
    standalone = load_model(str(out / "model")).state_dict()
    in_run = worker.trainer.model.state_dict()
    assert standalone.keys() == in_run.keys()
    assert all(torch.equal(standalone[k], in_run[k]) for k in standalone)
    first = json.loads((out / "sft_metrics.jsonl").read_text().splitlines()[0])
    assert m["sft/loss_first"] == first["sft/loss"]
    # molt run draws the warm start in chunks (for its progress bar): the same computation
    chunked = TrainerWorker(cfg)
    assert chunked.sft_begin() == 4
    got = [len(chunked.sft_next(3)), len(chunked.sft_next(3)), len(chunked.sft_next(3))]
    assert got == [3, 1, 0]
    state = chunked.trainer.model.state_dict()
    assert all(torch.equal(standalone[k], state[k]) for k in standalone)


def test_iter_sft_resume_matches_uninterrupted_and_refuses_without_optimizer_state(base):
    """Issue 28 item 5 at the function level: steps 0..1, then a fresh trainer resumed at step 2 with
    the weights and ``trainer.sft_optimizer``'s state of step 2 runs steps 2..3 exactly as one run;
    ``trainer.sft_optimizer`` is None once the last step ran; a resume without the state is refused."""
    from molt_core.train.sft import iter_sft

    model, tok = base
    kw = dict(steps=4, batch_size=3, lr=1e-2, seed=5)
    whole = Trainer(tiny_cfg(), model=copy.deepcopy(model), tokenizer=tok)
    want = [m["sft/loss"] for m in iter_sft(whole, add_examples(8), **kw)]
    assert whole.sft_optimizer is None
    first = Trainer(tiny_cfg(), model=copy.deepcopy(model), tokenizer=tok)
    it = iter_sft(first, add_examples(8), **kw)
    got = [next(it)["sft/loss"], next(it)["sft/loss"]]
    opt_state = copy.deepcopy(first.sft_optimizer.state_dict())
    second = Trainer(tiny_cfg(), model=copy.deepcopy(first.model), tokenizer=tok)
    got += [m["sft/loss"] for m in iter_sft(second, add_examples(8), **kw, start=2, opt_state=opt_state)]
    assert got == want
    a, b = whole.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for start, state in ((2, None), (4, opt_state)):
        with pytest.raises(ValueError, match=f"resuming at step {start} needs sft.steps > {start} \\(it is 4\\)"):
            next(iter_sft(second, add_examples(8), **kw, start=start, opt_state=state))
