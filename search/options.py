"""`SearchOptions`: every knob of `plan_search` in one validated object.

`plan_search(cluster, model, seq_len, options=SearchOptions(...))` and the keyword form
`plan_search(cluster, model, seq_len, n_trials=40, ...)` are the same call; the keywords
build a `SearchOptions`. Bad values fail with one `InputError` naming the option and what
is allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hexiseq.errors import InputError
from hexiseq.store import parse_database_url

STORAGE_URLS = (
    "give a SQLAlchemy URL such as sqlite:///optuna.db or postgresql://USER:PASSWORD@HOST/DB"
)


MAX_MICRO_BATCHES = 65536
"""Most sequences per step a plan may take one after another."""
PRECISIONS = ("auto", "bf16", "fp32")
MAX_WORKERS = 256
"""Most scoring processes a search may start."""


class SearchOptions(BaseModel):
    """How `plan_search` searches (every field optional; the defaults are the default search).

    - `time_budget_s`, `n_trials`: go on sampling with Optuna for this long / this many trials
      (neither: the screened short list and the polish only).
    - `seed`: makes the sampling deterministic for a given `n_trials` (with one worker).
    - `storage`: SQLAlchemy URL of an Optuna study to keep and resume; `study_name` names it.
    - `workers`: processes scoring the sampled trials (this process samples and keeps the
      study; `search.sampling`).
    - `multi_objective`: trade throughput against the fullest device's headroom (Pareto front).
    - `cost_model`: the cost model to plan with (default: the datasheet model).
    - `activation_checkpointing`: None lets the search drop the recompute wherever memory
      allows; True or False forces it.
    - `micro_batches`: sequences per step (the global batch): one mesh takes them one after
      another (gradient accumulation), data-parallel replicas share them.
    - `precision`: the compute dtype the plan is for and `hexiseq run` computes in: "bf16",
      "fp32", or "auto" (bf16 on GPUs, fp32 on an all-CPU cluster, as the runtime runs there);
      master weights, gradients and AdamW states are FP32 either way.
    - `show_progress`: a progress bar on stderr (Optuna's with one worker).
    - `data_parallel`: with several sequences per step, also plan data-parallel replicas
      sharing them (the cluster split by nodes, each part its own CP-HP mesh on its own
      sequences) and pick them where they are faster; False: one CP-HP mesh over the whole
      cluster only.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, arbitrary_types_allowed=True, allow_inf_nan=False, strict=True
    )

    time_budget_s: float | None = Field(default=None, gt=0)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    storage: str | None = None
    n_trials: int | None = Field(default=None, ge=1)
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    multi_objective: bool = False
    cost_model: Any = None
    activation_checkpointing: bool | None = None
    study_name: str | None = Field(default=None, min_length=1)
    micro_batches: int = Field(default=1, ge=1, le=MAX_MICRO_BATCHES)
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    show_progress: bool = False
    data_parallel: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> SearchOptions:
        required = ("attention_time_s", "transfer_time_s", "label")
        if self.cost_model is not None and not all(
            callable(getattr(self.cost_model, name, None)) for name in required
        ):
            raise ValueError(
                "cost_model must be a hexiseq cost model (DatasheetCostModel, a fitted model)"
            )
        return self

    @property
    def checkpointing_options(self) -> tuple[bool, ...]:
        """The activation-checkpointing settings the search may use."""
        if self.activation_checkpointing is None:
            return (False, True)
        return (self.activation_checkpointing,)

    @property
    def searching(self) -> bool:
        """Whether the Optuna layer samples beyond the short list."""
        return self.n_trials is not None or self.time_budget_s is not None

    @property
    def beside(self) -> bool:
        """Whether the search may hand work to its helper process (`search.helper`): the
        default search, which neither samples nor keeps a stored study."""
        return self.storage is None and not self.searching


def search_options(**keywords: Any) -> SearchOptions:
    """`SearchOptions(**keywords)`, bad values as one `InputError` (passwords masked)."""
    try:
        options = SearchOptions(**keywords)
    except ValidationError as error:
        raise InputError(_one_line(error)) from None
    if options.storage is not None:  # a URL Optuna cannot parse: one line, its password masked
        parse_database_url(options.storage, "storage URL", STORAGE_URLS)
    return options


_RULES = {
    "time_budget_s": "time budget must be positive seconds",
    "n_trials": "n_trials must be at least 1",
    "workers": f"workers must be from 1 to {MAX_WORKERS}",
    "study_name": "study name must not be empty",
    "seed": "seed must be a whole number from 0 to 2**32 - 1",
}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than_equal", "finite_number"}


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "options"
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(SearchOptions.model_fields)
        return f"plan_search has no option '{field}'; options: {allowed}"
    if field == "options":
        return first["msg"].removeprefix("Value error, ")
    generic = f"search option {field}: {first['msg'].lower()}"
    in_range = first["type"] in _RANGE_ERRORS or first["type"].startswith("string_too")
    rule = _RULES.get(field, generic) if in_range else generic
    return f"{rule} (got {value!r})"
