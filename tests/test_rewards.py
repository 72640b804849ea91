"""Text and math rewards, including the B13 cases of issue 6 with their exact values."""

from __future__ import annotations

import threading

import pytest

from molt_core.types import RewardFailed
from molt_plugins.rewards.base import check_options
from molt_plugins.rewards.basic import exact_match, regex
from molt_plugins.rewards.math_answer import extract_boxed, math_answer, math_equal

HALF = {"answer": r"\frac{1}{2}"}


# -- B13 ---------------------------------------------------------------------------------
def test_b13_boxed_fraction_graded():
    assert math_answer(r"The answer is \boxed{\frac{1}{3}}", HALF) == 0.0
    assert math_answer(r"The answer is \boxed{\frac{1}{2}}", HALF) == 1.0


def test_b13_extraction_by_balanced_braces():
    assert extract_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed(r"so $\boxed{\sqrt{\frac{1}{2}}}$.") == r"\sqrt{\frac{1}{2}}"
    assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"  # the last box is the answer
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces don't count
    assert extract_boxed("no box here") is None


def test_b13_denominator_digits_matter():
    assert math_equal(r"\frac{1}{23}", r"\frac{12}{3}") is False
    assert math_equal(r"\frac{12}{3}", r"\frac{1}{23}") is False
    assert math_answer(r"\boxed{\frac{12}{3}}", {"answer": r"\frac{1}{23}"}) == 0.0
    assert math_answer(r"\boxed{\frac{12}{3}}", {"answer": "4"}) == 1.0


def test_b13_unclosed_box_never_truncates():
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None
    # a gold equal to the truncated prefix must not match either
    assert math_answer(r"\boxed{\frac{1}{2}", {"answer": r"\frac{1"}) == 0.0
    assert math_answer(r"\boxed{\frac{1}{2}", HALF) == 0.0
    # an earlier complete box does not rescue a truncated final one
    assert extract_boxed(r"\boxed{3} ... \boxed{\frac{1}{2}") is None


def test_b13_fbox():
    assert extract_boxed(r"\fbox{42}") == "42"
    assert math_answer(r"final: \fbox{42}", {"answer": "42"}) == 1.0


def test_b13_only_the_response_is_scored():
    task = {"question": r"Is it \boxed{\frac{1}{2}}?", "answer": r"\frac{1}{2}"}
    assert math_answer("I don't know", task) == 0.0
    assert math_answer("", task) == 0.0


def test_math_equivalent_forms_and_fallback():
    assert math_answer(r"\boxed{0.5}", HALF) == 1.0
    assert math_answer(r"\boxed{\dfrac{2}{4}}", HALF) == 1.0
    assert math_answer("The answer is 1/2", HALF) == 0.0  # require_boxed (default)
    assert math_answer("The answer is $1/2$", HALF, require_boxed=False) == 1.0
    assert math_answer("The answer is $1/3$", HALF, require_boxed=False) == 0.0


def test_math_in_worker_thread():
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(math_answer(r"\boxed{\frac{2}{4}}", HALF)))
    th.start()
    th.join()
    assert out == [1.0]


def test_math_unparseable_gold_is_a_failure():
    with pytest.raises(RewardFailed) as ei:
        math_answer(r"\boxed{1}", {"answer": ""})
    assert ei.value.reason == "parse"
    with pytest.raises(KeyError, match="answer"):
        math_answer(r"\boxed{1}", {})


# -- exact match / regex -------------------------------------------------------------------
def test_exact_match():
    assert exact_match(" 68\n", {"answer": "68"}) == 1.0
    assert exact_match(" 68\n", {"answer": "68"}, strip=False) == 0.0
    assert exact_match("680", {"answer": "68"}) == 0.0
    assert exact_match("x", {"gold": "x"}, answer_field="gold") == 1.0
    with pytest.raises(KeyError):
        exact_match("68", {})


def test_regex_format_and_answer():
    fmt = dict(pattern=r"^<think>.*</think>\s*<answer>(.*)</answer>$", flags=["DOTALL"])
    good = "<think>a\nb</think>\n<answer>7</answer>"
    assert regex(good, {}, **fmt) == 1.0
    assert regex("<answer>7</answer>", {}, **fmt) == 0.0
    assert regex(good, {"answer": "7"}, **fmt, answer_group=1) == 1.0
    assert regex(good, {"answer": "8"}, **fmt, answer_group=1) == 0.0
    assert regex("ABC", {}, pattern="abc", flags=["IGNORECASE"], mode="fullmatch") == 1.0
    assert regex("xabc", {}, pattern="abc", mode="match") == 0.0
    assert regex("xabc", {}, pattern="abc", mode="search", match_reward=0.5) == 0.5


def test_regex_option_errors_name_the_field():
    with pytest.raises(ValueError, match=r"rewards.regex.pattern: .*not a valid regular expression"):
        regex("x", {}, pattern="(")
    with pytest.raises(ValueError, match=r"answer_group 2 is not a group"):
        regex("x", {}, pattern="(x)", answer_group=2)
    with pytest.raises(ValueError, match=r"rewards.regex.flags.0"):
        regex("x", {}, pattern="x", flags=["VERBOSE"])
    with pytest.raises(ValueError, match=r"rewards.my_regex.pattern: Field required"):
        check_options("my_regex", regex, {})
    check_options("my_regex", regex, {"pattern": "x"})


def test_every_registered_reward_has_options_and_is_listed():
    from molt_core.plugins import load_plugins

    host = load_plugins()
    for name in ("exact_match", "regex", "math_answer", "code_tests"):
        fn = host.get("rewards", name)
        assert "properties" in fn.Options.model_json_schema()
