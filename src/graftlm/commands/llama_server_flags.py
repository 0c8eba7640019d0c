"""Every other flag of llama-server, so that `graftlm serve` takes a llama-server command line.

The flags graftlm implements are declared where they belong (serve.py, llama_flags.py); the ones
below are declared too, so that none is refused or read as another flag (`-ngl 99` as `-n gl`).
Each given flag is then either mapped onto graftlm's own setting by `graftlm serve`
(`--verbose`, `--api-key-file`, `--predict`, ...), or noted on stderr, one line, as having no
effect here. The table follows `llama-server --help` of a current llama.cpp.
"""

from __future__ import annotations

import argparse
from typing import Any

# arity: "0" a switch, "1" one value, "?" an optional value. A note says why it has no effect;
# MAPPED means serve.py reads it.
MAPPED = "mapped"
_TABLE = """
-tb --threads-batch|1|graftlm uses -t threads for prompts and generation alike
-C --cpu-mask -Cr --cpu-range -Cb --cpu-mask-batch -Crb --cpu-range-batch|1|no CPU affinity control
--cpu-strict --cpu-strict-batch --prio --prio-batch --poll --poll-batch|1|no thread priority control
--keep|1|no context shift, so no tokens to keep
--swa-full|0|the KV cache keeps every position already
--perf --no-perf -e --escape --no-escape|0|no effect
--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale|1|RoPE comes from the GGUF file
--yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast|1|RoPE comes from the GGUF file
-kvo --kv-offload -nkvo --no-kv-offload --repack -nr --no-repack --no-host|0|no effect
-dt --defrag-thold|1|the paged KV cache needs no defragmentation
--rpc|1|no RPC backends
-lm --load-mode -lzm --lazy-mode|1|weights are memory-mapped
--list-devices|0|no effect
-dev|1|graftlm's --device chooses where the model runs (cpu, cuda, cuda:N)
-ot --override-tensor -ncmoe --n-cpu-moe -ncffn --n-cpu-ffn|1|no tensor placement control
-cmoe --cpu-moe --check-tensors|0|no effect
-sm --split-mode -ts --tensor-split -mg --main-gpu|1|one device (--device)
-fit --fit|?|no effect
-fitt --fit-target -fitc --fit-ctx|1|no effect
--override-kv|1|GGUF metadata is read as it is
--op-offload --no-op-offload|0|no effect
--control-vector --control-vector-scaled|1|no control vectors
--control-vector-layer-range|2|no control vectors
-dr --docker-repo|1|graftlm downloads nothing
-hft --hf-token|1|graftlm downloads nothing
--log-disable --log-jsonl --no-log-jsonl --log-prefix --no-log-prefix|0|no effect
--log-timestamps --no-log-timestamps|0|no effect
--log-file|1|graftlm logs to stderr
--log-colors|?|no effect
-v --verbose --log-verbose|0|mapped
-lv --verbosity --log-verbosity|1|mapped
--offline|0|graftlm never downloads
--spec-draft-type-k -ctkd --cache-type-k-draft --spec-draft-type-v -ctvd --cache-type-v-draft|1|the draft model's KV cache is float16
--samplers --sampler-seq --sampling-seq|1|graftlm's sampler order is fixed (penalties, top-k, top-p, min-p, temperature)
--ignore-eos|0|set ignore_eos in the request
--temperature|1|mapped
--predict|1|mapped
--top-nsigma --top-n-sigma --xtc-probability --xtc-threshold --typical --typical-p|1|set it in the request
--repeat-last-n --repeat-penalty --presence-penalty --frequency-penalty|1|set it in the request
--dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker|1|set it in the request
--adaptive-target --adaptive-decay --dynatemp-range --dynatemp-exp|1|set it in the request
--mirostat --mirostat-lr --mirostat-ent|1|set it in the request
-l --logit-bias --grammar --grammar-file -j --json-schema -jf --json-schema-file|1|set it in the request
-bs --backend-sampling --backend_sampling|0|sampling runs beside the engine step
-hfd -hfrd --hf-repo-draft --spec-draft-hf|1|graftlm downloads nothing
-td --threads-draft --spec-draft-threads -tbd --threads-batch-draft --spec-draft-threads-batch|1|the draft model runs on the engine's threads and device
-Cd --cpu-mask-draft --spec-draft-cpu-mask -Crd --cpu-range-draft --spec-draft-cpu-range|1|the draft model runs on the engine's threads and device
--spec-draft-cpu-strict --cpu-strict-draft --spec-draft-prio --prio-draft|1|the draft model runs on the engine's threads and device
--spec-draft-poll --poll-draft -Cbd --cpu-mask-batch-draft --spec-draft-cpu-mask-batch|1|the draft model runs on the engine's threads and device
--spec-draft-cpu-strict-batch --cpu-strict-batch-draft --spec-draft-prio-batch --prio-batch-draft|1|the draft model runs on the engine's threads and device
--spec-draft-poll-batch --poll-batch-draft -otd --override-tensor-draft --spec-draft-override-tensor|1|the draft model runs on the engine's threads and device
-cmoed --cpu-moe-draft --spec-draft-cpu-moe|0|the draft model runs on the engine's threads and device
-ncmoed --n-cpu-moe-draft --spec-draft-ncmoe --spec-draft-n-cpu-moe|1|the draft model runs on the engine's threads and device
--spec-draft-p-split --draft-p-split|1|drafts are greedy, from the draft model's top token
--spec-draft-backend-sampling --no-spec-draft-backend-sampling|0|drafts are greedy, from the draft model's top token
--spec-draft-sampling|1|drafts are greedy, from the draft model's top token
-devd --device-draft --spec-draft-device|1|the draft model runs on the engine's threads and device
-ngld --gpu-layers-draft --n-gpu-layers-draft --spec-draft-ngl|1|the draft model runs on the engine's threads and device
--spec-ngram-mod-n-min --spec-ngram-mod-n-max --spec-ngram-mod-n-match|1|graftlm's one n-gram drafter takes --spec-ngram-simple-size-n and --spec-ngram-simple-size-m
--spec-ngram-simple-min-hits|1|graftlm's one n-gram drafter takes --spec-ngram-simple-size-n and --spec-ngram-simple-size-m
--spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits|1|graftlm's one n-gram drafter takes --spec-ngram-simple-size-n and --spec-ngram-simple-size-m
--spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits|1|graftlm's one n-gram drafter takes --spec-ngram-simple-size-n and --spec-ngram-simple-size-m
--draft --draft-n --draft-max --draft-min --draft-n-min|1|removed from llama-server: --spec-draft-n-max / --spec-draft-n-min
--spec-ngram-size-n --spec-ngram-size-m --spec-ngram-min-hits|1|removed from llama-server: --spec-ngram-simple-size-n / -size-m
--spec-default|0|no preset: --spec-type ngram-simple
-lcs --lookup-cache-static -lcd --lookup-cache-dynamic|1|no lookup decoding
--kv-unified-per-slot|1|one sequence may use the whole KV pool already
-ctxcp --ctx-checkpoints --swa-checkpoints -cms --checkpoint-min-step|1|no context checkpoints
-cram --cache-ram|1|cached prefixes live in the KV pool (--kv-memory sizes it)
-kvu --kv-unified -no-kvu --no-kv-unified|0|the KV pool is shared by all sequences
--cache-idle-slots --no-cache-idle-slots|0|cached prefixes stay until their room is needed
-r --reverse-prompt|1|set stop in the request
-sp --special|0|no effect
--warmup --no-warmup --spm-infill|0|no effect
--pooling|1|mapped
-mm --mmproj -mmu --mmproj-url -mmdev --mmproj-device|1|no vision or audio
--mmproj-auto --no-mmproj --no-mmproj-auto --mmproj-offload --no-mmproj-offload|0|no vision or audio
--image-min-tokens --image-max-tokens --mtmd-batch-max-tokens|1|no vision or audio
--video-fps --video-timestamp-interval --video-ffmpeg-dir --media-path|1|no vision or audio
--tags|1|mapped
--embd-normalize|1|embeddings are L2-normalized
--reuse-port|0|no effect
--path|1|graftlm serves its own chat page
--cors-methods --cors-headers|1|CORS allows every method and header the API uses
--cors-credentials --no-cors-credentials|0|no effect
--api-prefix|1|no path prefix
--ui-config --webui-config --ui-config-file --webui-config-file|1|graftlm serves its own chat page
--ui-mcp-proxy --webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy|0|no MCP proxy
--tools --tools-runtime --mcp-servers-config --mcp-servers-json|1|no built-in tools or MCP servers (--tools: CORS defaults to localhost, as llama-server's)
-ag --agent -no-ag --no-agent|0|no built-in agent
--ui --webui|0|the chat page is on
--no-ui --no-webui|0|mapped
--embedding --embeddings|0|embeddings are always served beside completions
--rerank --reranking|0|/rerank is always served
--api-key-file|1|mapped
--ssl-key-file --ssl-cert-file|1|no TLS: put a TLS proxy in front
--sse-ping-interval --threads-http|1|no effect
--cache-prompt|0|mapped
--cache-reuse|1|prefixes are reused in whole blocks
--metrics|0|mapped
--no-metrics|0|mapped
--props|0|POST /props is not supported
--slots|0|mapped
--no-slots|0|mapped
--slot-save-path|1|slots cannot be saved (/slots/ID?action=save answers 501)
--models-dir --models-preset --models-max|1|no router mode: one base model, adapters by name
--models-autoload --no-models-autoload|0|no router mode: one base model, adapters by name
--jinja --no-jinja|0|chat templates are always rendered with Jinja
--reasoning-format --reasoning-effort|1|mapped
--reasoning-budget --reasoning-budget-message|1|no reasoning control
--reasoning-preserve --no-reasoning-preserve|0|no reasoning control
--skip-chat-parsing --no-skip-chat-parsing|0|no effect
--prefill-assistant --no-prefill-assistant|0|a final assistant message is always continued
-sps --slot-prompt-similarity|1|the prefix cache matches whole blocks, not slots
--log-prompts-dir|1|no prompt log
--grp-attn-n -gan --grp-attn-w -gaw|1|no self-extend
"""


def _rows() -> list[tuple[list[str], str, str]]:
    rows = []
    for line in _TABLE.strip().splitlines():
        flags, arity, note = line.split("|", 2)
        rows.append((flags.split(), arity, note))
    return rows


def dest_of(flag: str) -> str:
    return "lsf_" + flag.lstrip("-").replace("-", "_")


def add_llama_server_flags(p: argparse.ArgumentParser) -> None:
    """Declare every row's flags that `p` does not already have (each its own dest, so that
    `--slots` and `--no-slots` stay apart)."""
    taken = set(p._option_string_actions)
    g = p.add_argument_group(
        "llama-server's other flags: accepted; mapped, or noted as having no effect"
    )
    for flags, arity, _ in _rows():
        for flag in flags:
            if flag in taken:
                continue
            kw: dict[str, Any] = {"dest": dest_of(flag), "help": argparse.SUPPRESS}
            if arity == "0":
                kw.update(action="store_true", default=None)
            elif arity == "?":
                kw.update(nargs="?", const="on", default=None)
            elif arity == "2":
                kw.update(nargs=2, default=None)
            else:
                kw.update(default=None)
            g.add_argument(flag, **kw)


def given(args: argparse.Namespace, *flags: str) -> Any:
    """The value of the first of `flags` that was given (True for a switch), else None."""
    for flag in flags:
        value = getattr(args, dest_of(flag), None)
        if value is not None:
            return value
    return None


def llama_server_notes(args: argparse.Namespace) -> list[str]:
    """One note per given flag that has no effect here (mapped flags: none)."""
    notes = []
    for flags, _, note in _rows():
        for flag in flags:
            value = getattr(args, dest_of(flag), None)
            if value is None or note == MAPPED:
                continue
            shown = flag if value is True else f"{flag} {value}"
            notes.append(f"{shown}: no effect; {note}")
    return notes
