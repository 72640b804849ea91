"""Validators and JSON round trips of molt_core.types (issue 2, item 2)."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from molt_core.types import PolicyVersion, Result, SamplingParams, Segment, Trajectory


def seg(**kw):
    base = dict(
        token_ids=[5, 6, 7, 8],
        loss_mask=[False, False, True, True],
        logprobs=[None, None, -0.5, -1.25],
        versions=[None, None, 3, 4],
    )
    base.update(kw)
    return Segment(**base)


def test_valid_segment_counts():
    s = seg()
    assert len(s) == 4
    assert s.num_sampled == 2
    assert s.oldest_version() == 3


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("loss_mask", [False, True, True], "loss_mask has length 3 but token_ids has length 4"),
        ("logprobs", [None, -0.1, -0.5, -1.25], "logprobs[1] is set on a non-sampled token"),
        ("logprobs", [None, None, None, -1.25], "logprobs[2] is missing on a sampled token"),
        ("versions", [None, None, None, 4], "versions[2] is missing on a sampled token"),
        ("versions", [0, None, 3, 4], "versions[0] is set on a non-sampled token"),
        ("logprobs", [None, None, 0.25, -1.25], "logprobs[2] = 0.25 is positive"),
        ("logprobs", [None, None, float("nan"), -1.25], "logprobs[2] = nan is not finite"),
        ("logprobs", [None, None, -0.5, float("-inf")], "logprobs[3] = -inf is not finite"),
        ("routed_experts", [[[0, 1]]] * 3, "routed_experts has first dimension 3 but token_ids has length 4"),
    ],
)
def test_segment_rejects_misalignment(field, value, needle):
    with pytest.raises(ValidationError) as e:
        seg(**{field: value})
    assert needle in str(e.value)


def test_routed_experts_ok_and_ragged_rejected():
    ok = seg(routed_experts=[[[0, 1], [2, 3]]] * 4)
    assert len(ok.routed_experts) == 4
    with pytest.raises(ValidationError, match=r"routed_experts\[2\] has shape"):
        seg(routed_experts=[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1]], [[0, 1], [2, 3]]])


def test_span_params_default_and_bounds():
    s = seg(token_ids=[1, 2, 3, 4, 5], loss_mask=[False, True, True, False, True],
            logprobs=[None, -1.0, -1.0, None, -2.0], versions=[None, 0, 0, None, 1])
    assert [(p.start, p.end) for p in s.span_params()] == [(1, 3), (4, 5)]
    with pytest.raises(ValidationError, match=r"spans\[0\].end = 9 exceeds the token count 4"):
        seg(spans=[{"start": 2, "end": 9}])


def test_failed_trajectory_needs_error():
    with pytest.raises(ValidationError, match="error is empty"):
        Trajectory(status="failed")
    t = Trajectory(segments=[seg()], reward=1.0).fail("reward timed out")
    assert t.status == "failed" and t.reward is None and t.error == "reward timed out"


def test_policy_version_orders_and_rejects_negative():
    v = PolicyVersion(3)
    assert v.next() == 4 and v < 4 and int(v) == 3
    assert v > 2 and v >= 3 and 2 < v and 4 > v and not v > 3
    with pytest.raises(ValidationError):
        PolicyVersion(-1)


def test_sampling_params_and_result_validation():
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValidationError, match="temperatur"):
        SamplingParams(temperatur=1.0)
    with pytest.raises(ValidationError, match="reward must be finite"):
        Result(reward=math.inf)


# ---- property tests -----------------------------------------------------------------

finite_lp = st.floats(min_value=-50.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def segments(draw):
    n = draw(st.integers(min_value=0, max_value=40))
    ids = draw(st.lists(st.integers(0, 200_000), min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    lps = [draw(finite_lp) if m else None for m in mask]
    vers = [draw(st.integers(0, 10_000)) if m else None for m in mask]
    routed = None
    if draw(st.booleans()):
        layers, k = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        routed = [[[draw(st.integers(-1, 7)) for _ in range(k)] for _ in range(layers)] for _ in range(n)]
    return Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vers, routed_experts=routed,
                   finish_reason=draw(st.sampled_from([None, "stop", "length"])))


@settings(max_examples=150, deadline=None)
@given(st.lists(segments(), min_size=1, max_size=3),
       st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=64)))
def test_trajectory_json_round_trip_exact(segs, reward):
    t = Trajectory(group_id="g1", segments=segs, reward=reward, info={"k": [1, 2]})
    back = Trajectory.model_validate_json(t.model_dump_json())
    assert back == t
    for a, b in zip(back.segments, t.segments):
        assert a.token_ids == b.token_ids and a.versions == b.versions
        # floats survive bit-exactly
        assert [x.hex() if x is not None else None for x in a.logprobs] == \
               [x.hex() if x is not None else None for x in b.logprobs]
    assert json.loads(t.model_dump_json())["rollout_id"] == t.rollout_id


@settings(max_examples=150, deadline=None)
@given(segments(), st.sampled_from(["loss_mask", "logprobs", "versions", "flip"]), st.data())
def test_random_misalignments_rejected(s, how, data):
    d = s.model_dump()
    n = len(d["token_ids"])
    if how == "flip":
        if n == 0:
            return
        i = data.draw(st.integers(0, n - 1))
        d["loss_mask"][i] = not d["loss_mask"][i]  # now logprob/version presence disagrees
    else:
        # add or drop one entry of a per-token list
        if n > 0 and data.draw(st.booleans()):
            d[how] = d[how][:-1]
        else:
            d[how] = d[how] + [d[how][0] if n else None]
    with pytest.raises(ValidationError):
        Segment.model_validate(d)


def test_segment_images_validated_and_stored_once_per_trajectory():
    import hashlib

    from molt_core.types import ImageRef

    digest = hashlib.sha256(b"png-bytes").hexdigest()
    ids = [1, 2, 2, 2, 3, 9]
    mask = [False] * 5 + [True]
    lps: list = [None] * 5 + [-0.5]
    vers: list = [None] * 5 + [0]
    im = ImageRef(sha256=digest, start=1, end=4, grid_thw=[1, 2, 6])
    seg = Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vers, images=[im])
    t = Trajectory(segments=[seg, seg], images={digest: "cG5nLWJ5dGVz"})
    assert len(t.images) == 1 and t.segments[1].images[0].end == 4
    with pytest.raises(ValidationError, match="is not in images"):
        Trajectory(segments=[seg])
    with pytest.raises(ValidationError, match=r"images\[0\].end = 7 exceeds the token count 6"):
        Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vers,
                images=[ImageRef(sha256=digest, start=1, end=7, grid_thw=[1, 2, 6])])
    with pytest.raises(ValidationError, match="covers sampled tokens"):
        Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vers,
                images=[ImageRef(sha256=digest, start=4, end=6, grid_thw=[1, 2, 4])])
    with pytest.raises(ValidationError, match="not overlap"):
        Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vers,
                images=[im, ImageRef(sha256=digest, start=3, end=4, grid_thw=[1, 2, 2])])
    with pytest.raises(ValidationError, match="sha256"):
        ImageRef(sha256="xyz", start=0, end=1, grid_thw=[1, 1, 1])
    with pytest.raises(ValidationError, match="must exceed start"):
        ImageRef(sha256=digest, start=2, end=2, grid_thw=[1, 1, 1])
