"""Reward signatures and the registry of reward functions (registered names, DATA_SOURCE_DEFAULTS, "auto").

Three signatures are accepted. They are told apart by parameter names (``inspect.signature``) when a function is
loaded (``load_reward_fn``, rlworkers.rewards.loading) or registered (``register_reward_fn``); verl's two are wrapped
into rlflow's, so every caller sees one batch signature:

1. rlflow's batch signature (any function not recognised as 2. or 3., unchanged)::

       def reward_fn(prompts: list[str], responses: list[str], **columns) -> list[float]: ...

   ``columns`` are the batch's other columns for the same rows, one list each: every column of the dataset's rows
   (``answer``, verl's ``reward_model`` and ``extra_info`` dicts, ``ability``, your own), ``ground_truth`` (None
   for a row without one) and ``data_source``. Accept ``**columns`` and ignore what you do not need. A column
   may not be named ``prompts`` or ``responses``.

2. verl's per-sample signature (what verl's ``custom_reward_function.path``/``.name`` names), recognised by
   parameters named ``solution_str`` and ``ground_truth``::

       def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict: ...

   called once per row with keywords, as verl's NaiveRewardManager does: ``data_source`` from the ``data_source``
   column, ``solution_str`` the decoded response, ``ground_truth`` from the ``ground_truth`` column (else
   ``answer``, else ``reward_model["ground_truth"]``; None when the row has none), ``extra_info`` from the
   ``extra_info`` column (None when absent). Only the parameters it names are passed (all four if it takes
   ``**kwargs``); one it requires beyond these four is an error when it is loaded.

3. verl's batch signature (verl's BatchRewardManager), recognised by parameters named ``solution_strs`` and
   ``ground_truths``::

       def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list[float | dict]: ...

   called once per batch with keywords, the same values as lists.

What a function returns: one value per response (for 2., one per call), each a finite number, or a dict with a
finite ``score`` and extra values (verl's ``reward_extra_info``), e.g. ``{"score": 1.0, "acc": True}``. The score
is the reward; every other key becomes a per-row number (``compute_reward_values``' extras, the reward output's
``reward_extra/<key>`` columns, the ``reward_extra/<key>/mean`` metric). Extra values must be numbers or bools
(None, or a row without the key, gives NaN, left out of the mean); a key with any other value (a string, a list)
is dropped with one warning naming it. A dict without ``score`` is an error.

A row without a ground truth is refused before a run starts when the reward compares with one
(``needs_ground_truth``): the rules exact, gsm8k and last_number, and verl's signatures unless ``ground_truth`` has a
default (``ground_truth=None`` says the function copes without one). rlflow's batch signature is not checked unless
the function says it needs one (``fn.needs_ground_truth = True``; ``False`` turns the check off for any function).

Registered names: "exact", "gsm8k", "last_number", "format", "environment" (a multi-turn rollout's environment and
tool rewards, its ``agent/reward`` column), and "auto" (per row, by the ``data_source`` column,
through DATA_SOURCE_DEFAULTS). rlworkers.rewards.loading resolves a reward spec to a function, and
rlworkers.rewards.scoring calls one and checks its result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

from rlworkers.rewards.rule import exact_answer_reward, format_reward, gsm8k_reward, last_number_reward

RewardFn = Callable[..., Sequence[float]]

GROUND_TRUTH_COLUMNS = ("ground_truth", "answer")
# The names rlflow's batch signature gives its first two arguments: a column cannot have them.
RESERVED_COLUMNS = ("prompts", "responses")
# Parameter names of verl's signatures, in the order of (data_source, solution_str, ground_truth, extra_info).
VERL_PARAMETERS: dict[str, tuple[str, str, str, str]] = {
    "verl": ("data_source", "solution_str", "ground_truth", "extra_info"),
    "verl_batch": ("data_sources", "solution_strs", "ground_truths", "extra_infos"),
}
_STYLE_NAMES = {
    "rlflow": "rlflow's reward_fn(prompts, responses, **columns)",
    "verl": "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None)",
    "verl_batch": "verl's batch compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)",
}


class MissingGroundTruthError(ValueError):
    """A rule that compares with a ground truth got a row without one; ``row`` is its index in the batch."""

    def __init__(self, message: str, row: int | None = None):  # row has a default: exceptions unpickle as cls(*args)
        super().__init__(message)
        self.row = row


def row_ground_truth(columns: Mapping[str, Sequence], i: int):
    """Row ``i``'s ground truth: its ``ground_truth`` column, else ``answer``, else verl's
    ``reward_model["ground_truth"]``; None when it has none."""
    for key in GROUND_TRUTH_COLUMNS:
        if key in columns and columns[key][i] is not None:
            return columns[key][i]
    reward_model = columns["reward_model"][i] if "reward_model" in columns else None
    return reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None


def _ground_truths(columns: dict, name: str, prompts: Sequence[str]) -> list:
    if not any(key in columns for key in (*GROUND_TRUTH_COLUMNS, "reward_model")):
        raise ValueError(
            f"reward {name!r} needs one of the columns {[*GROUND_TRUTH_COLUMNS, 'reward_model']}; got "
            f"{sorted(columns)}. Fix: add an 'answer' or 'ground_truth' column to the dataset"
        )
    truths = [row_ground_truth(columns, i) for i in range(len(prompts))]
    for i, truth in enumerate(truths):
        if truth is None:
            source = columns["data_source"][i] if "data_source" in columns else None
            raise MissingGroundTruthError(
                f"reward {name!r}: row {i} has no ground truth: add an 'answer'/'ground_truth' column or "
                "reward_model.ground_truth to the dataset (or set data.answer_key to the column that holds it), or "
                f"choose a reward that needs none (the row: data_source {source!r}, prompt {str(prompts[i])[:60]!r})",
                row=i,
            )
    return truths


def per_sample(score_fn: Callable[[str, str], float], name: str) -> RewardFn:
    """Turn ``score_fn(response, ground_truth) -> float`` into a batch reward function. A row without a ground
    truth (see ``row_ground_truth``) raises ``MissingGroundTruthError`` naming the row."""

    def reward_fn(prompts: list[str], responses: list[str], **columns) -> list[float]:
        truths = _ground_truths(columns, name, prompts)
        return [float(score_fn(r, t)) for r, t in zip(responses, truths, strict=True)]

    reward_fn.__name__ = reward_fn.__qualname__ = f"{name}_reward"
    reward_fn.needs_ground_truth = True
    return reward_fn


def environment_reward(prompts: list[str], responses: list[str], **columns) -> list[float]:
    """A multi-turn rollout's own reward (``agent/reward``: its environment's step rewards plus its tools'
    ``calc_reward``, see ``rlworkers.workers.rollout.agent_loop``)."""
    if "agent/reward" not in columns:
        raise ValueError(
            "reward 'environment' scores multi-turn rollouts by their agent/reward column, which this batch has not: "
            "set rollout.multi_turn.enable=true with an environment or tools, or choose another reward"
        )
    return [float(reward) for reward in columns["agent/reward"]]


def _format_batch(prompts: list[str], responses: list[str], **columns) -> list[float]:
    return [format_reward(r) for r in responses]


_format_batch.needs_ground_truth = False


def needs_ground_truth(fn: Callable, data_source: str | None = None) -> bool:
    """Whether ``fn`` compares each response with its row's ground truth, so that a row without one must be refused
    before a run starts. A function says so itself with a ``needs_ground_truth`` attribute; otherwise verl's
    signatures need one unless their ``ground_truth(s)`` parameter has a default (``ground_truth=None`` declares it
    optional), and rlflow's batch signature does not (it gets ``ground_truth`` None for such rows). ``auto``
    needs what the rule of ``data_source`` needs."""
    if fn is auto_reward:
        return data_source in DATA_SOURCE_DEFAULTS and needs_ground_truth(reward_fn_for_data_source(data_source))
    declared = getattr(fn, "needs_ground_truth", None)
    if declared is not None:
        return bool(declared)
    if isinstance(fn, VerlRewardFn):
        parameter = inspect.signature(fn.fn).parameters.get(VERL_PARAMETERS[fn.style][2])
        return parameter is None or parameter.default is parameter.empty
    return False


# ------------------------------------------------------------------------------------------- verl's signatures
def reward_fn_style(fn: Callable) -> str:
    """Which signature ``fn`` has, by its parameter names: "verl" (``solution_str`` and ``ground_truth``),
    "verl_batch" (``solution_strs`` and ``ground_truths``), else "rlflow" (also when it has no signature)."""
    if isinstance(fn, VerlRewardFn):
        return "rlflow"
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins and C callables
        return "rlflow"
    for style, names in VERL_PARAMETERS.items():
        if names[1] in parameters and names[2] in parameters:
            return style
    return "rlflow"


class VerlRewardFn:
    """A verl ``compute_score`` (``style`` "verl": per sample, or "verl_batch") behind rlflow's batch signature
    (see the module docstring for what it is called with). A module-level class, so cloudpickle ships an instance
    by reference to this class and by value to a function loaded from a file."""

    def __init__(self, fn: Callable, style: str):
        if style not in VERL_PARAMETERS:
            raise ValueError(f"unknown verl reward style {style!r}; use one of {sorted(VERL_PARAMETERS)}")
        self.fn, self.style = fn, style
        names = VERL_PARAMETERS[style]
        parameters = inspect.signature(fn).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in parameters):
            self.passed = names
        else:
            self.passed = tuple(
                n for n in names if any(p.name == n and p.kind is not p.POSITIONAL_ONLY for p in parameters)
            )
        required = [
            p.name
            for p in parameters
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in self.passed
        ]
        if required:
            raise ValueError(
                f"reward function {describe_reward_fn(fn)} has {_STYLE_NAMES[style]}'s parameter names but also "
                f"requires {required}, which are not passed (only {list(names)}, by keyword); give them defaults"
            )

    def __call__(self, prompts: list[str], responses: list[str], **columns) -> list:
        n = len(responses)
        values = (
            _column(columns, "data_source", n),
            list(responses),
            [row_ground_truth(columns, i) for i in range(n)],
            _column(columns, "extra_info", n),
        )
        names = VERL_PARAMETERS[self.style]
        if self.style == "verl_batch":
            return self.fn(**{name: v for name, v in zip(names, values) if name in self.passed})
        rows = [{name: v for name, v in zip(names, row) if name in self.passed} for row in zip(*values)]
        return [self.fn(**kwargs) for kwargs in rows]

    def __repr__(self) -> str:
        return f"VerlRewardFn({describe_reward_fn(self)}, style={self.style!r})"


def _column(columns: Mapping[str, Sequence], key: str, n: int) -> list:
    return list(columns[key]) if key in columns else [None] * n


def describe_reward_fn(fn: Callable) -> str:
    """A name for error messages: the spec it was loaded by (``load_reward_fn`` records it), else module.qualname
    (of the user's function, for a wrapped verl one)."""
    if isinstance(fn, VerlRewardFn):
        fn = fn.fn
    spec = getattr(fn, "__rlflow_reward_spec__", None)
    if spec:
        return spec
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{getattr(fn, '__module__', '?')}.{qualname}"


def as_batch_reward_fn(fn: Callable) -> RewardFn:
    """``fn`` with rlflow's batch signature: a verl-signature function wrapped in ``VerlRewardFn``, any other
    callable (and an already wrapped one) returned as it is.

    Raises:
        ValueError: a verl-signature function requires parameters verl does not pass.
    """
    style = reward_fn_style(fn)
    return fn if style == "rlflow" else VerlRewardFn(fn, style)


# ------------------------------------------------------------------------------------------------ the registry
REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact": per_sample(exact_answer_reward, "exact"),
    "gsm8k": per_sample(gsm8k_reward, "gsm8k"),
    "last_number": per_sample(last_number_reward, "last_number"),
    "format": _format_batch,
    "environment": environment_reward,
}

# data_source value -> registered reward name, used by "auto".
DATA_SOURCE_DEFAULTS: dict[str, str] = {
    "addition": "exact",
    "addition_chat": "last_number",  # the built-in task asked in a chat template (data.task.prompt_format)
    "addition_gsm8k": "gsm8k",
    "addition_tool": "last_number",  # the same asked with the add tool (multi-turn): the answer's last number
    "gsm8k": "gsm8k",
    "openai/gsm8k": "gsm8k",
}


def register_reward_fn(name: str, fn: Callable, *, overwrite: bool = False) -> None:
    """Add ``fn`` (any accepted signature; a verl one is wrapped) to the registry under ``name``.

    Raises:
        ValueError: the name is taken (pass overwrite=True to replace it) or contains ':'.
    """
    if ":" in name or name == "auto":
        raise ValueError(f"reward name {name!r} is reserved or contains ':'; choose another name")
    if name in REWARD_FUNCTIONS and not overwrite:
        raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
    REWARD_FUNCTIONS[name] = as_batch_reward_fn(fn)


def reward_fn_for_data_source(data_source: str) -> RewardFn:
    """The registered reward for a data_source value.

    Raises:
        ValueError: no default for it; the message lists the known data sources.
    """
    if data_source not in DATA_SOURCE_DEFAULTS:
        raise ValueError(
            f"no default reward for data_source {data_source!r}; known: {sorted(DATA_SOURCE_DEFAULTS)}. "
            "Fix: name a reward function explicitly (reward spec) or add the data source to DATA_SOURCE_DEFAULTS"
        )
    return REWARD_FUNCTIONS[DATA_SOURCE_DEFAULTS[data_source]]


def auto_reward(prompts: list[str], responses: list[str], **columns) -> list:
    """Score each row with the default reward of its ``data_source`` (rows grouped per source). Returns what those
    functions return per row (numbers, or dicts with ``score``)."""
    if "data_source" not in columns:
        raise ValueError("reward 'auto' needs a 'data_source' column; name a reward function instead")
    columns = {key: list(values) for key, values in columns.items()}
    sources = columns["data_source"]
    scores: list = [0.0] * len(responses)
    for source in dict.fromkeys(sources):
        rows = [i for i, s in enumerate(sources) if s == source]
        picked = {key: [values[i] for i in rows] for key, values in columns.items()}
        fn = reward_fn_for_data_source(source)
        try:
            result = fn([prompts[i] for i in rows], [responses[i] for i in rows], **picked)
        except MissingGroundTruthError as e:  # its row number is the one among this source's rows
            message = str(e).replace(f"row {e.row} ", f"row {rows[e.row]} ", 1)
            raise MissingGroundTruthError(message, row=rows[e.row]) from None
        for i, score in zip(rows, result, strict=True):
            scores[i] = score
    return scores
