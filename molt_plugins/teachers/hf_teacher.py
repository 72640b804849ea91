"""``hf_teacher``: a frozen Hugging Face causal LM giving per-token logprobs for on-policy
distillation (the ``on_policy_distill`` advantage, Agarwal et al. 2023, arXiv 2306.13649;
Thinking Machines "On-policy distillation", 2025).

The teacher must share the student's tokenizer -- the student's sampled token ids are scored
by the teacher as they are, never re-tokenized -- so the vocabularies are compared at start
and a mismatch is an error naming both. The teacher's logprob of token ``t_i`` is
``log_softmax(teacher_logits[i - 1])[t_i]`` of the raw (temperature 1, unfiltered)
distribution; position 0 has none.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from molt_plugins.vision.processor import is_vision_model, load_vision_processor, padded_inputs

__all__ = ["HFTeacher", "HFTeacherOptions", "check_same_vocab"]


class HFTeacherOptions(BaseModel):
    """``path`` -- HF model directory or ``builtin:<name>``; ``gguf_file``; ``dtype``;
    ``seed`` -- init seed of a builtin (random) model; ``batch_size`` -- sequences per forward."""

    model_config = ConfigDict(extra="forbid")

    path: str
    gguf_file: str | None = None
    dtype: str = "float32"
    seed: int = 0
    batch_size: int = Field(16, ge=1)


def _name(tok: Any) -> str:
    return str(getattr(tok, "name_or_path", None) or type(tok).__name__)


def check_same_vocab(teacher_tok: Any, student_tok: Any) -> None:
    """Raise unless both tokenizers map the same strings to the same ids.

    Raises:
        ValueError: naming both tokenizers, their sizes and the first differing entries.
    """
    tv, sv = teacher_tok.get_vocab(), student_tok.get_vocab()
    if tv == sv:
        return
    t_inv = {i: s for s, i in tv.items()}
    s_inv = {i: s for s, i in sv.items()}
    diffs = [i for i in sorted(set(t_inv) | set(s_inv)) if t_inv.get(i) != s_inv.get(i)][:3]
    shown = "; ".join(f"id {i}: teacher {t_inv.get(i)!r} vs student {s_inv.get(i)!r}" for i in diffs)
    raise ValueError(
        f"the teacher's vocabulary ({_name(teacher_tok)}, {len(tv)} tokens) differs from the student's "
        f"({_name(student_tok)}, {len(sv)} tokens): {shown}. On-policy distillation scores the student's "
        f"token ids with the teacher, so both must share one tokenizer"
    )


class HFTeacher:
    """Frozen teacher model (``eval()``, no gradients).

    Args:
        student_tokenizer: the student's tokenizer (checked against the teacher's).
        **options: :class:`HFTeacherOptions` fields.

    Raises:
        ValueError: invalid options, or the vocabularies differ (see :func:`check_same_vocab`).
        FileNotFoundError: ``path`` is neither a builtin nor a directory.
    """

    Options = HFTeacherOptions
    molt_example = {"options": {"path": "builtin:tiny-qwen3"}}
    """Options for ``molt plugins --check`` (``path`` has no default)."""

    def __init__(self, student_tokenizer: Any, **options: Any) -> None:
        from molt_core.models import length_dependent_rope, load_model, load_tokenizer
        from molt_plugins.rewards.base import validate_options

        self.options: HFTeacherOptions = validate_options(HFTeacherOptions, options, "teacher")  # type: ignore[assignment]
        o = self.options
        self.tokenizer = load_tokenizer(o.path, gguf_file=o.gguf_file)
        check_same_vocab(self.tokenizer, student_tokenizer)
        self.model = load_model(o.path, dtype=o.dtype, gguf_file=o.gguf_file, seed=o.seed)
        self.model.requires_grad_(False)
        self.model.eval()
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        #: sequences per forward: 1 when the rotary factors depend on a forward's longest position
        #: (longrope, dynamic NTK: :func:`molt_core.models.length_dependent_rope`), so a sequence's
        #: logprobs never depend on the sequences batched with it
        self.batch_size = 1 if length_dependent_rope(self.model.config) else o.batch_size

        #: the teacher's image processor (a vision-language teacher), else None
        self.vision = load_vision_processor(o.path, self.tokenizer) if is_vision_model(self.model) else None

    def batch_token_logprobs(self, sequences: Sequence[Sequence[int]],
                             images: Sequence[Sequence[bytes]] | None = None) -> list[list[float | None]]:
        """Teacher logprob of every token given its prefix, per sequence.

        Args:
            sequences: token-id lists (any lengths >= 1).
            images: per sequence, the encoded bytes of its images in token order (each image's
                ``<|image_pad|>`` run expanded in the ids); None or empty lists for text. A
                vision-language teacher sees them as the policy did (pixels and 3D positions,
                :func:`molt_plugins.vision.processor.padded_inputs`).

        Returns:
            One list per sequence, same length: ``None`` at position 0, else the float
            ``log p_teacher(t_i | t_<i)`` (natural log, computed in float32).

        Raises:
            ValueError: an empty sequence, an id outside the teacher's embedding table, images
                for a teacher that is not a vision-language model, or image runs that the
                teacher's processor expands to other lengths.
        """
        import torch

        out: list[list[float | None]] = []
        V = self.model.get_input_embeddings().num_embeddings
        images = images if images is not None else [[] for _ in sequences]
        if len(images) != len(sequences):
            raise ValueError(f"images has {len(images)} entries for {len(sequences)} sequences; give one list per sequence")
        if any(images) and self.vision is None:
            raise ValueError(f"the teacher ({self.options.path}) is not a vision-language model: it cannot score "
                             "rollouts with images; use a vision-language teacher")
        for k in range(0, len(sequences), self.batch_size):
            chunk = [list(map(int, s)) for s in sequences[k:k + self.batch_size]]
            imgs = [list(x) for x in images[k:k + self.batch_size]]
            for j, s in enumerate(chunk):
                if not s:
                    raise ValueError(f"sequence {k + j} is empty")
                bad = [t for t in s if not 0 <= t < V]
                if bad:
                    raise ValueError(f"sequence {k + j} has token id {bad[0]} outside the teacher's vocabulary [0, {V})")
            T = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), T), self.pad_id, dtype=torch.long)
            att = torch.zeros((len(chunk), T), dtype=torch.long)
            for j, s in enumerate(chunk):  # right padding: positions of real tokens are unchanged
                ids[j, : len(s)] = torch.tensor(s)
                att[j, : len(s)] = 1
            kw = padded_inputs(self.model, self.vision, list(zip(chunk, imgs)), T)
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=att, **kw).logits.float()  # [B, T, V]
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
            for j, s in enumerate(chunk):
                out.append([None] + [float(x) for x in lp[j, : len(s) - 1]])
        return out

    def token_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        """:meth:`batch_token_logprobs` of one sequence."""
        return self.batch_token_logprobs([token_ids])[0]

    def trajectory_logprobs(self, trajectory: Any) -> list[list[float | None]]:
        """Per segment of ``trajectory``, the teacher logprob of each *sampled* token (None
        on prompt / tool tokens): the ``info["teacher_logprobs"]`` format the trainer reads.
        A segment's images (``Trajectory.images``) are shown to the teacher as to the policy."""
        import base64

        segs = trajectory.segments
        imgs = [[base64.b64decode(trajectory.images[r.sha256]) for r in s.images] for s in segs]
        full = self.batch_token_logprobs([s.token_ids for s in segs], imgs) if segs else []
        return [[x if m else None for x, m in zip(lps, s.loss_mask)] for lps, s in zip(full, segs)]

    def annotate(self, trajectory: Any) -> Any:
        """A copy of ``trajectory`` with ``info["teacher_logprobs"]`` set."""
        info = {**trajectory.info, "teacher_logprobs": self.trajectory_logprobs(trajectory)}
        return trajectory.model_copy(update={"info": info})
