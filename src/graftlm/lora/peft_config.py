"""adapter_config.json: which modules of a PEFT LoRA carry a delta, and PEFT's factor for each.

Semantics follow PEFT (0.21) exactly: `target_modules` is a list of names (a module matches when
its full name equals one or ends with "." + one) or a regex matched with `re.fullmatch`;
`layers_to_transform` / `layers_pattern` restrict list matches to some layer indices;
`exclude_modules` wins over both. A module's rank and alpha come from the first `rank_pattern` /
`alpha_pattern` key that matches its full name as `(.*\\.)?{key}$`, else from `r` /
`lora_alpha`; the factor is alpha / r, or alpha / sqrt(r) with `use_rslora`.
Fields that select a LoRA variant graftlm does not compute are refused by name.

The file is untrusted: every field's type is checked, numbers must be finite and within float32's
range, and the patterns are compiled when the config is read (a bad one is named) and matched
with the `regex` package under a time limit, so a catastrophic pattern such as `(.|.)*X` is
refused in a fraction of a second instead of freezing the process (Python's `re` cannot be
interrupted, not even by Ctrl-C).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import regex

from graftlm.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
MATCH_SECONDS = 0.25  # per match of a config pattern against a module name; normal ones take us
FLOAT32_MAX = 3.4028234663852886e38
MAX_RANK = 1 << 16


class Pattern:
    """A pattern of the config, compiled once, matched with a time limit."""

    __slots__ = ("field", "source", "_re")

    def __init__(self, source: str, field: str, wrap: str = "{}") -> None:
        self.field, self.source = field, source
        self._re = regex.compile(wrap.format(source))  # regex.error for a malformed one

    def fullmatch(self, text: str) -> bool:
        return self.match(text, whole=True) is not None

    def match(self, text: str, whole: bool = False) -> regex.Match[str] | None:
        try:
            fn = self._re.fullmatch if whole else self._re.match
            return fn(text, timeout=MATCH_SECONDS)
        except TimeoutError:
            raise AdapterError(
                f"{self.field} pattern {self.source[:80]!r} takes more than {MATCH_SECONDS} s to "
                "match one module name (catastrophic backtracking): not used"
            ) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pattern) and other.source == self.source

    def __hash__(self) -> int:
        return hash(self.source)

    def __repr__(self) -> str:
        return repr(self.source)


# Config fields that change what the adapter computes and that graftlm does not implement.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (use_dora): a learned magnitude per output row is not supported",
    "lora_bias": "lora_bias: LoRA B biases are not supported",
    "modules_to_save": "modules_to_save: fully saved layers are not supported (only LoRA deltas)",
    "trainable_token_indices": "trainable_token_indices: trainable token rows are not supported",
    "layer_replication": "layer_replication: replicated layers are not supported",
    "use_qalora": "use_qalora: QA-LoRA is not supported",
    "use_bdlora": "use_bdlora: block-diagonal LoRA is not supported",
    "arrow_config": "arrow_config: Arrow routing is not supported",
    "velora_config": "velora_config: VeLoRA is not supported",
    "monteclora_config": "monteclora_config: MonteCLoRA is not supported",
    "kasa_config": "kasa_config: KaSA is not supported",
    "megatron_config": "megatron_config: Megatron-parallel layers are not supported",
}


@dataclass(frozen=True)
class PeftConfig:
    """The fields of adapter_config.json that decide which modules carry a LoRA and its factor."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[Pattern, int] = field(default_factory=dict)
    alpha_pattern: dict[Pattern, float] = field(default_factory=dict)
    target_modules: tuple[str, ...] | Pattern | str | None = None  # str: only "all-linear"
    exclude_modules: tuple[str, ...] | Pattern | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[Pattern, ...] = ()
    ensure_weight_tying: bool = False
    invocation_tokens: tuple[int, ...] = ()  # aLoRA
    # bare parameters with a LoRA (ParamWrapper): only routed experts' are read (lora.peft_experts)
    target_parameters: tuple[str, ...] = ()

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, alpha) of one module, after rank_pattern / alpha_pattern (PEFT's first match)."""
        r = next((v for k, v in self.rank_pattern.items() if k.fullmatch(module)), self.r)
        a = next((v for k, v in self.alpha_pattern.items() if k.fullmatch(module)), self.lora_alpha)
        return r, a

    def scaling(self, module: str) -> float:
        r, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """Whether PEFT would put a LoRA on `module` (peft's check_target_module_exists)."""
        ex = self.exclude_modules
        if ex and (ex.fullmatch(module) if isinstance(ex, Pattern) else _name_in(module, ex)):
            return False
        tm = self.target_modules
        if tm is None:
            return False
        if tm == "all-linear":  # PEFT's shorthand: every linear layer but the output head
            return module != "lm_head" and not module.endswith("embed_tokens")
        if isinstance(tm, Pattern):
            return tm.fullmatch(module)
        assert not isinstance(tm, str)
        if module in tm:
            return True
        if not _name_in(module, tm):
            return False
        if self.layers_to_transform is None:
            return True
        m = None
        if self.layers_pattern:
            for p in self.layers_pattern:
                m = p.match(module)
                if m:
                    break
        else:
            m = regex.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        return m is not None and int(m.group("idx")) in self.layers_to_transform


def _name_in(module: str, names: tuple[str, ...]) -> bool:
    return module in names or any(module.endswith("." + n) for n in names)


def parse_config(raw: Any, where: str, problems: list[str]) -> PeftConfig | None:
    """Check adapter_config.json; append every refusal to `problems`. None when unusable."""
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a JSON object, got {type(raw).__name__}")
        return None
    ptype = raw.get("peft_type")
    if ptype != "LORA":
        problems.append(f"{where}: peft_type is {ptype!r}; only LORA adapters are supported")
        return None
    _refuse_variants(raw, where, problems)

    def num(key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        v = raw.get(key, default)
        if not _positive(v, kind):
            problems.append(
                f"{where}: {key} must be a positive number, got {v!r} (finite, at most 3.4e38)"
            )
            return None
        return v

    r = num("r", 8, int)
    alpha = num("lora_alpha", 8, (int, float))
    if r is not None and r > MAX_RANK:
        problems.append(f"{where}: r = {r} is past any real adapter's rank (at most {MAX_RANK})")
    rank_pattern = _pattern_dict(
        raw.get("rank_pattern") or {}, int, "rank_pattern", where, problems
    )
    alpha_pattern = _pattern_dict(
        raw.get("alpha_pattern") or {}, (int, float), "alpha_pattern", where, problems
    )
    tm = _modules(raw.get("target_modules"), "target_modules", where, problems)
    ex = _modules(raw.get("exclude_modules"), "exclude_modules", where, problems)
    ltt = _layers_to_transform(raw, where, problems)
    layer_patterns = _layers_pattern(raw, where, problems)
    invocation = _invocation_tokens(raw, where, problems)
    tp = _target_parameters(raw, where, problems)
    if r is None or alpha is None:
        return None
    return PeftConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=rank_pattern,
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        target_modules=tm,
        exclude_modules=ex if not isinstance(ex, str) else None,
        layers_to_transform=ltt,
        layers_pattern=layer_patterns,
        ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)),
        invocation_tokens=invocation,
        target_parameters=tp,
    )


def _refuse_variants(raw: dict[str, Any], where: str, problems: list[str]) -> None:
    """The fields that select a LoRA variant graftlm does not compute, each named."""
    for key, why in _UNSUPPORTED.items():
        if raw.get(key):
            problems.append(f"{where}: {why} ({key} = {json.dumps(raw[key])})")
    if str(raw.get("init_lora_weights", "")).lower() == "mica":
        problems.append(
            f"{where}: init_lora_weights 'mica' selects the MiCA variant, which is not supported"
        )
    if raw.get("bias", "none") != "none":
        problems.append(f"{where}: bias = {raw['bias']!r}: trained base biases are not supported")


def _layers_to_transform(
    raw: dict[str, Any], where: str, problems: list[str]
) -> tuple[int, ...] | None:
    ltt_raw: Any = raw.get("layers_to_transform")
    if isinstance(ltt_raw, int) and not isinstance(ltt_raw, bool):
        ltt_raw = [ltt_raw]
    ltt: tuple[int, ...] | None = None
    if ltt_raw is not None and not _ints(ltt_raw):
        problems.append(f"{where}: layers_to_transform must be a layer index or a list of them")
    elif ltt_raw:
        ltt = tuple(ltt_raw)
    return ltt


def _layers_pattern(raw: dict[str, Any], where: str, problems: list[str]) -> tuple[Pattern, ...]:
    lp = raw.get("layers_pattern")
    lp = [lp] if isinstance(lp, str) and lp else lp or []
    layer_patterns = []
    if not isinstance(lp, list) or not all(isinstance(x, str) for x in lp):
        problems.append(f"{where}: layers_pattern must be a string or a list of strings")
    else:
        for x in lp:
            pat = _compile(x, "layers_pattern", where, problems, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")
            if pat is not None:
                layer_patterns.append(pat)
    return tuple(layer_patterns)


def _invocation_tokens(raw: dict[str, Any], where: str, problems: list[str]) -> tuple[int, ...]:
    """aLoRA's alora_invocation_tokens: token ids."""
    invocation: list[int] = raw.get("alora_invocation_tokens") or []
    if not _ints(invocation) or any(t < 0 for t in invocation):
        problems.append(f"{where}: alora_invocation_tokens must be a list of token ids")
        invocation = []
    return tuple(invocation)


def _target_parameters(raw: dict[str, Any], where: str, problems: list[str]) -> tuple[str, ...]:
    """target_parameters: names of bare parameters with a LoRA (only routed experts' are read,
    by lora.peft_experts)."""
    tp: Any = raw.get("target_parameters") or []
    if not isinstance(tp, list) or not all(isinstance(x, str) for x in tp):
        problems.append(f"{where}: target_parameters must be a list of parameter names")
        tp = []
    return tuple(tp)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _compile(
    source: str, key: str, where: str, problems: list[str], wrap: str = "{}"
) -> Pattern | None:
    try:
        return Pattern(source, key, wrap)
    except (regex.error, OverflowError, RecursionError) as exc:
        problems.append(f"{where}: {key} pattern {source[:80]!r} does not compile ({exc})")
        return None


def _modules(
    v: Any, key: str, where: str, problems: list[str]
) -> tuple[str, ...] | Pattern | str | None:
    """target_modules / exclude_modules: a regex (a string), or a list of module names."""
    if v is None:
        return None
    if isinstance(v, str):
        return (
            v
            if v == "all-linear" and key == "target_modules"
            else _compile(v, key, where, problems)
        )
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return tuple(v)
    problems.append(f"{where}: {key} must be a string (a regex) or a list of module names")
    return None


def _positive(v: Any, kind: type | tuple[type, ...]) -> bool:
    ok: bool = not isinstance(v, bool) and isinstance(v, kind)
    return ok and math.isfinite(float(v)) and 0 < float(v) <= FLOAT32_MAX


def _pattern_dict(
    d: Any, kind: type | tuple[type, ...], key: str, where: str, problems: list[str]
) -> dict[Pattern, Any]:
    if (
        not isinstance(d, dict)
        or not all(isinstance(k, str) for k in d)
        or not all(_positive(v, kind) for v in d.values())
    ):
        problems.append(
            f"{where}: {key} must map module patterns to positive finite numbers, got {d!r}"[:300]
        )
        return {}
    out = {}
    for k, v in d.items():  # PEFT's rule: a key matches a module named (.*\.)?{key}$
        pat = _compile(k, key, where, problems, r"(.*\.)?({})$")
        if pat is not None:
            out[pat] = v
    return out
