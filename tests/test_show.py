"""Decoded text in trajectories.jsonl (display only), log_samples rows for logger plugins, and
`molt show RUN_DIR` (issue 13 item 5)."""

import json

import pytest
from click.testing import CliRunner

from molt_core.cli import main
from molt_core.config import RunConfig
from molt_core.models import load_tokenizer
from molt_core.runtime.rundir import RunLog, decode_turns
from molt_core.types import Segment, Trajectory

TOK = load_tokenizer("builtin:tiny-qwen3")
PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "yes<|im_end|>"
OBS = "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
ANSWER2 = "no<|im_end|>"


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


def two_turns(reward=1.0, rollout_id="r-two"):
    """One segment: prompt, sampled answer (version 3), observation, sampled answer (version 4)."""
    parts = [(enc(PROMPT), None), (enc(ANSWER), 3), (enc(OBS), None), (enc(ANSWER2), 4)]
    ids, mask, lps, vs = [], [], [], []
    for toks, v in parts:
        ids += toks
        mask += [v is not None] * len(toks)
        lps += [-0.5 if v is not None else None] * len(toks)
        vs += [v] * len(toks)
    seg = Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vs)
    return Trajectory(rollout_id=rollout_id, segments=[seg], reward=reward, task={"answer": "yes"})


def test_decode_turns_cuts_context_and_sampled_runs():
    turns = decode_turns(two_turns(), TOK)
    assert turns == [{"segment": 0, "context": PROMPT, "response": ANSWER, "versions": [3, 3]},
                     {"segment": 0, "context": OBS, "response": ANSWER2, "versions": [4, 4]}]
    # a segment that ends on context (nothing sampled after it) still shows that context
    seg = Segment(token_ids=enc(PROMPT), loss_mask=[False] * len(enc(PROMPT)), logprobs=[None] * len(enc(PROMPT)),
                  versions=[None] * len(enc(PROMPT)))
    assert decode_turns(Trajectory(segments=[seg]), TOK) == [{"segment": 0, "context": PROMPT, "response": "",
                                                             "versions": None}]


class _Host:
    def __init__(self, loggers):
        self.loggers = loggers

    def get(self, kind, name):
        return self.loggers[name]

    def on_step_end(self, step, metrics):
        pass


class _PlainLogger:
    """A logger plugin without ``log_samples``."""

    def __init__(self, run_dir, cfg):
        pass

    def log(self, step, metrics):
        pass

    def close(self):
        pass


class _SampleLogger(_PlainLogger):
    seen: list = []

    def log_samples(self, step, rows):
        _SampleLogger.seen.append((step, rows))


def test_runlog_writes_turns_and_hands_log_samples_exact_rows(tmp_path):
    cfg = RunConfig.model_validate({"loggers": ["samples", "plain"]})
    log = RunLog(tmp_path, cfg, _Host({"samples": _SampleLogger, "plain": _PlainLogger}), resume_step=None)
    ok = two_turns()
    failed = Trajectory(rollout_id="r-bad", status="failed", error="RuntimeError: boom")
    before = [ok.model_dump(), failed.model_dump()]
    _SampleLogger.seen.clear()
    log.trajectories(10, [ok, failed], TOK)
    assert [ok.model_dump(), failed.model_dump()] == before  # the trajectories themselves never change
    rows = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert rows[0]["turns"][1]["response"] == ANSWER2 and rows[1]["turns"] == []
    assert len(_SampleLogger.seen) == 1
    step, samples = _SampleLogger.seen[0]
    assert step == 10
    assert samples[0] == {"prompt": PROMPT, "completion": ANSWER2, "reward": 1.0, "status": "ok"}
    assert samples[1]["prompt"] == "" and samples[1]["completion"] == "" and samples[1]["status"] == "failed"
    assert samples[1]["reward"] != samples[1]["reward"]  # NaN: a failed rollout is unscored
    # no tokenizer: token ids only, and no samples for the loggers
    log.trajectories(11, [ok])
    assert "turns" not in json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[-1])
    assert len(_SampleLogger.seen) == 1


def fixture_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    RunConfig().write(run / "config.toml")
    log = RunLog(run, RunConfig(), _Host({}), resume_step=None)
    log.trajectories(1, [Trajectory(rollout_id="r-old", status="failed", error="ValueError: early")], TOK)
    log.trajectories(10, [two_turns(0.5, "r-new"), two_turns(1.0, "r-second")], TOK)
    log.trajectories(20, [two_turns(1.0, "r-ids-only")])  # an older row: token ids only
    return run


def test_molt_show_prints_turns_reward_status_versions(tmp_path):
    run = fixture_run(tmp_path)
    res = CliRunner().invoke(main, ["show", str(run), "--step", "10", "-n", "1"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "\x1b[" not in out  # not a terminal: plain text
    assert "step 10, 1 of 2 sampled rollouts" in out
    assert "r-new  ok  reward 0.500  versions 3-4" in out and "r-second" not in out
    assert out.index("[turn 1] context:") < out.index("hi<|im_end|>") < out.index("[turn 1] response (v3):")
    assert "[turn 2] response (v4):\nno<|im_end|>" in out
    assert 'task: answer="yes"' in out


def test_molt_show_defaults_and_errors(tmp_path):
    run = fixture_run(tmp_path)
    # default: the latest step; its row has ids only and is decoded with the run's own tokenizer
    res = CliRunner().invoke(main, ["show", str(run)], catch_exceptions=False)
    assert res.exit_code == 0 and "r-ids-only" in res.output and "[turn 2] response (v4):\nno<|im_end|>" in res.output
    res = CliRunner().invoke(main, ["show", str(run), "--step", "1"], catch_exceptions=False)
    assert "r-old  failed  reward -" in res.output and "error: ValueError: early" in res.output
    res = CliRunner().invoke(main, ["show", str(run), "--step", "7"])
    assert res.exit_code == 2 and "steps with samples: 1, 10, 20" in res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(main, ["show", str(empty)])
    assert res.exit_code == 2 and "trajectories.jsonl: no such file" in res.output


@pytest.mark.parametrize("m,text", [
    ({"eval/pass@1": 0.25, "eval/failed": 0.0, "eval/rollouts": 8.0}, "pass@1 0.250"),
    ({"eval/pass@1": 0.25, "eval/failed": 3.0, "eval/rollouts": 8.0},
     "pass@1 0.250 (3 of 8 eval rollouts failed, counted unsolved)"),
    ({"eval/pass@1": 0.0, "eval/failed": 8.0, "eval/rollouts": 8.0}, "all 8 eval rollouts failed (no pass@1)"),
])
def test_eval_summary_says_how_many_eval_rollouts_failed(m, text):
    from molt_core.runtime.loop import _eval_summary

    assert _eval_summary(m) == text


def test_image_placeholder_runs_are_collapsed_for_display():
    from molt_core.cli.show import collapse_images

    ctx = "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 16 + "<|vision_end|>How many?<|im_end|>"
    assert collapse_images(ctx) == "<|im_start|>user\n<|vision_start|>[image: 16 tokens]<|vision_end|>How many?<|im_end|>"
    two = "<|image_pad|>" * 4 + "x" + "<|image_pad|>"
    assert collapse_images(two) == "[image: 4 tokens]x[image: 1 tokens]"
    assert collapse_images("no images") == "no images"
