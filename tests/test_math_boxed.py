"""Issue 11 item 7: the textually last box of either form is the answer -- braced
``\\boxed{...}`` / ``\\fbox{...}`` and brace-less ``\\boxed 5`` / ``\\boxed5`` / ``\\fbox 5``."""

from __future__ import annotations

import pytest

from molt_plugins.rewards.math_answer import extract_boxed, math_answer


def test_braceless_box_of_the_issue_scores_one():
    # the reported fault: this scored 0.0
    assert math_answer(r"... so the answer is $\boxed 5$.", {"answer": "5"}) == 1.0
    assert math_answer(r"... so the answer is $\boxed 4$.", {"answer": "5"}) == 0.0


@pytest.mark.parametrize("text, want", [
    (r"so the answer is $\boxed 5$.", "5"),
    (r"$\boxed5$", "5"),                       # a control word ends at the first non-letter
    (r"\boxed 42.", "42"),                     # whole run, trailing sentence period dropped
    (r"\fbox 7", "7"),
    (r"\fbox7", "7"),
    (r"\[ \boxed 3 \] then prose", "3"),       # display math ends at \]
    (r"\( \boxed{x} \) and \(\boxed -1\)", "-1"),
    ("\\boxed\n 9", "9"),                      # one line break is a space to TeX
    (r"\boxed\frac12", r"\frac12"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nesting still by brace depth
    (r"\boxed {\frac{1}{2}}", r"\frac{1}{2}"),  # a space before the brace is legal TeX
    (r"\boxed{1} and then $\boxed 2$", "2"),   # mixed forms: the textually last wins
    (r"$\boxed 2$ and then \boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"\fbox 1 \boxed{2} \fbox{3}", "3"),
])
def test_extract_last_box_either_form(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize("text", [
    r"\boxedx 3",                    # another control word, not a box
    r"\boxed",                       # nothing to box
    r"\boxed{3} then $\boxed 4$ \boxed{5",  # the last box is truncated: no answer at all
    "\\boxed\n\n5",                  # a blank line is a paragraph, not an argument
])
def test_no_answer(text):
    assert extract_boxed(text) is None


def test_braceless_graded_by_math_verify():
    half = {"answer": r"\frac{1}{2}"}
    assert math_answer(r"\boxed\frac12", half) == 1.0
    assert math_answer(r"$\boxed 0.5$", half) == 1.0
    assert math_answer(r"$\boxed 0.4$", half) == 0.0
    assert math_answer(r"\boxed 42.", {"answer": "42"}) == 1.0
    assert math_answer(r"$\boxed 4$ wait, no: \boxed{5}", {"answer": "5"}) == 1.0
    assert math_answer(r"\boxed{5} wait, no: $\boxed 4$", {"answer": "5"}) == 0.0
    assert math_answer(r"$\boxed .$", {"answer": "5"}) == 0.0  # empty after punctuation


@pytest.mark.parametrize("text, want", [
    (r"\boxed 4. Check: 2+3=5", "4"),             # review 11 finding 7: prose after the box is no answer
    (r"The answer is \boxed 5 apples.", "5"),
    (r"\boxed 3.14.", "3.14"),                     # a decimal point stays, the full stop goes
    (r"\boxed -3, since", "-3"),
    (r"\boxed 5\quad done", "5"),                  # a control word after the argument ends it
    (r"\boxed \sqrt2 is it", r"\sqrt2"),           # a leading control word is part of the word
    (r"\boxed x = 5", "x"),                        # one word only: use braces for x = 5
    (r"\boxed 7! is big", "7!"),                   # a factorial, not punctuation
])
def test_braceless_argument_is_one_word(text, want):
    assert extract_boxed(text) == want


def test_braceless_box_followed_by_prose_is_graded_on_the_box_only():
    assert math_answer(r"\boxed 4. Check: 2+3=5", {"answer": "5"}) == 0.0
    assert math_answer(r"The answer is \boxed 5 apples.", {"answer": "5"}) == 1.0
    assert math_answer(r"\boxed 5. Check: 2+3=5", {"answer": "5"}) == 1.0
