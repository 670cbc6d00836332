"""Stage 2, extract: the target's hidden states for every completion, under an explicit kernel backend.

Everything that can be checked without the GPU (settings, completions, token ids, layer ids,
backend availability) is checked before the inference server is paused. The model is loaded and
run inside `server_paused`, and its memory is released before the server comes back.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_eval.cache import completions_check
from dflash_eval.cache.resume import ResumeState, plan_key, plan_shards, prepare_resume
from dflash_eval.cache.reuse import KeptStates, keep_published, legacy_state_code_hashes
from dflash_eval.cache.sampling import SamplingParams
from dflash_eval.cache.writer import CacheWriter
from dflash_eval.completions import read_completions
from dflash_eval.config import RUNTIME_HELP, settings_from_args, stage_settings
from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.backends import (
    BackendInfo,
    BackendRun,
    package_versions,
    select_backend,
    use_backend,
)
from dflash_eval.extract.capture import capture_layers, check_layer_ids
from dflash_eval.extract.positions import past_positions
from dflash_eval.extract.settings import extract_settings
from dflash_eval.extract.target import (
    load_target,
    read_config_json,
    target_config_hash,
    text_config_dict,
)
from dflash_eval.extract.target_logprobs import completion_logprobs, sampling_by_id
from dflash_eval.provenance.fingerprint import FingerprintCache
from dflash_eval.provenance.identity import state_code_hash
from dflash_eval.provenance.stamps import STAMP, stage_stamp

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", help="extract params as JSON (from config.extract_params)")
    parser.add_argument("--config", help="config.yaml, instead of --settings (with --dataset and --layers)")
    parser.add_argument("--dataset", help="dataset name in config.yaml")
    parser.add_argument("--layers", help="comma-separated layer ids, e.g. 1,16,31,46,61")
    parser.add_argument("--runtime", help=RUNTIME_HELP)
    parser.add_argument("--completions", required=True, help="results/completions/{dataset}.jsonl")
    parser.add_argument("--out", required=True, help="cache directory, results/hidden/{dataset}/{layerset}")


def parse_layers(text: str) -> list[int]:
    """'1,16,31' -> [1, 16, 31]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise DflashEvalError(f"--layers {text!r}: expected comma-separated integers such as 1,16,31") from None


def settings_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """--settings JSON (and --runtime), or settings built from --config, --dataset and --layers: comma-separated
    ids (1,16,31: the last layer as the final norm gives it, the default) or the cache directory's layer-set name
    (L1-16-31, L1-16-31-prenorm), which extract.settings.extract_settings takes."""
    from dflash_eval.drafters import layerset_name

    layers = args.layers
    if layers is not None and not layers.strip().startswith("L"):
        layers = layerset_name(parse_layers(layers), "final_norm")
    return settings_from_args(
        argparse.Namespace(**{**vars(args), "layers": layers}), extract_settings, "dataset", "layers"
    )


@dataclass
class TokenReport:
    """Records whose token ids are not exactly the server's: flagged, and fatal in strict mode."""

    mismatch: list[str] = field(default_factory=list)
    retokenized: list[str] = field(default_factory=list)

    def to_manifest(self) -> dict[str, list[str]]:
        return {"mismatch": self.mismatch, "retokenized": self.retokenized}


def check_tokens(records: list[dict[str, Any]], strict: bool) -> TokenReport:
    """Flag token_check mismatches and retokenized completions; raise on any in strict mode."""
    report = TokenReport()
    for record in records:
        check = record.get("token_check") or {}
        if any(value is False for value in check.values()):
            report.mismatch.append(str(record["id"]))
        if record.get("completion_ids_source") == "retokenized":
            report.retokenized.append(str(record["id"]))
    for kind, ids in (("token_check mismatch", report.mismatch), ("retokenized completion ids", report.retokenized)):
        if ids:
            log.warning("%d of %d samples flagged: %s (e.g. %s)", len(ids), len(records), kind, ids[:5])
    if strict and (report.mismatch or report.retokenized):
        examples = (report.mismatch + report.retokenized)[:5]
        raise DflashEvalError(
            f"strict_tokens: {len(report.mismatch)} samples with token_check mismatches and "
            f"{len(report.retokenized)} with retokenized completions (e.g. {examples}); "
            "re-fetch with token ids from the server, or set strict_tokens: false to accept them"
        )
    return report


def _check_token_range(records: list[dict[str, Any]], vocab_size: int) -> None:
    """Out-of-range ids would crash inside the embedding kernel; say which sample instead."""
    for record in records:
        ids = record["prompt_token_ids"] + record["completion_token_ids"]
        if any(not 0 <= t < vocab_size for t in ids):
            raise DflashEvalError(
                f"sample {record['id']!r} has token ids outside the target's vocabulary "
                f"(size {vocab_size}); the completions come from another model"
            )


def _server_paused(server: dict[str, Any] | None) -> AbstractContextManager:
    if server is None:  # tests and by-hand runs without a server; the workflow always passes one (--runtime)
        log.warning(
            "no server settings (the workflow passes them as --runtime JSON): no inference server is "
            "paused, so a server on this GPU keeps its memory while the target loads"
        )
        return nullcontext()
    from dflash_eval.server.control import server_paused

    return server_paused(server)


def _release_device_memory(device: torch.device) -> None:
    """Free the model's GPU memory before the server restarts (module graphs hold reference cycles)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _greedy_matches(tokens: torch.Tensor, argmax: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """How many completion tokens equal the target's argmax at the previous position (device scalar).

    The completions are the server's greedy output of this target, so this should be near 100%;
    a low value means another model, template or backend produced them.
    """
    return (argmax[prompt_len - 1 : -1] == tokens[prompt_len:]).sum()


def _upload(ids: list[int], device: torch.device) -> torch.Tensor:
    """Token ids on `device`; to a GPU through pinned memory, so the copy does not wait for the queue.

    A plain `torch.tensor(ids, device=cuda)` synchronizes the stream: the CPU would then stop
    queueing kernels until the previous forward has finished, and the GPU would idle at every sample.
    """
    tokens = torch.tensor(ids, dtype=torch.long)
    if device.type == "cuda":
        return tokens.pin_memory().to(device, non_blocking=True)
    return tokens.to(device)


def _length(record: dict[str, Any]) -> int:
    return len(record["prompt_token_ids"]) + len(record["completion_token_ids"])


def run_records(
    model: torch.nn.Module | None,
    records: list[dict[str, Any]],
    settings: dict[str, Any],
    backend: BackendRun | None,
    writer: CacheWriter,
    resume: ResumeState | None = None,
    reuse: KeptStates | None = None,
) -> dict[str, int] | None:
    """One verified forward per record, captured layers to the writer; returns the argmax agreement.

    Shards end where `plan_shards` says (the resume plan when resuming). With `resume`, shards an
    earlier run finished are adopted as they are and their records skipped (their argmax agreement
    is then not counted); with `reuse`, the records it holds are copied from the kept cache instead
    of computed (no model needed when it holds them all).
    """
    layer_ids, store_argmax = list(settings["layer_ids"]), bool(settings["store_argmax"])
    sampling = (
        {i: SamplingParams(**d) for i, d in writer.header["target_logprobs"]["sampling"].items()}
        if writer.store_logprob
        else None
    )
    device = torch.device(settings["target"]["device"])
    plan = resume.plan if resume else plan_shards([_length(r) for r in records], writer.shard_tokens)
    todo = [records[i] for index, shard in enumerate(plan) if not (resume and index in resume.kept) for i in shard]
    matches, completion_tokens = torch.zeros((), dtype=torch.long, device=device), 0
    with tqdm(
        total=sum(map(_length, todo)), unit="tok", unit_scale=True, desc=f"extract {settings.get('dataset', '')}"
    ) as bar:
        for record in _planned(records, plan, resume, writer):
            sample_id = str(record["id"])
            ids = record["prompt_token_ids"] + record["completion_token_ids"]
            prompt_len = len(record["prompt_token_ids"])
            logprob = None
            if reuse is not None and sample_id in reuse:
                tokens, states, argmax = reuse.states(sample_id, layer_ids, store_argmax, device)
            else:
                tokens = _upload(ids, device)
                logprobs = (
                    None
                    if sampling is None
                    else (
                        lambda head, hidden, t=tokens, n=prompt_len, s=sampling[sample_id]: completion_logprobs(
                            head, hidden, t, n, s
                        )
                    )
                )
                captured = capture_layers(
                    model,
                    layer_ids,
                    tokens,
                    want_argmax=store_argmax,
                    last_layer=settings["last_layer"],
                    logprobs=logprobs,
                )
                backend.verify()
                states, argmax, logprob = captured.states, captured.argmax, captured.logprob
            writer.add(sample_id, tokens, states, argmax, prompt_len, logprob)
            if store_argmax:
                matches += _greedy_matches(tokens, argmax, prompt_len)
                completion_tokens += len(ids) - prompt_len
            bar.update(len(ids))
    return {"matches": int(matches), "tokens": completion_tokens} if store_argmax else None


def _planned(records: list[dict[str, Any]], plan: list[list[int]], resume: ResumeState | None, writer: CacheWriter):
    """The records to compute, in plan order, adopting finished shards on the way."""
    for index, shard in enumerate(plan):
        if resume and index in resume.kept:
            writer.adopt(index, resume.kept[index])
            continue
        for i in shard:
            yield records[i]
        writer.close_shard()  # runs once the consumer has added the shard's last record


def _state_key(settings: dict[str, Any], header: dict[str, Any], code: str | None = None) -> str:
    """Everything that decides a sample's states besides its own token ids (cache.reuse); header["target"]
    holds last_layer, so a kept cache under the other last-layer convention is not reused. `code`: the state
    code's key (this release's, provenance.identity.state_code_hash, by default)."""
    target = settings["target"]
    weights = sorted(str(p) for p in Path(target["path"]).glob("*.safetensors"))
    return plan_key(
        {
            "target": header["target"],
            "weights": FingerprintCache().files(weights, "target.path"),
            "layer_ids": list(settings["layer_ids"]),
            "store_argmax": bool(settings["store_argmax"]),
            "device": torch.device(target["device"]).type,
            "backend": target["backend"],
            "versions": package_versions(),
            "code": code or state_code_hash(),
            **({"target_logprobs": header["target_logprobs"]} if "target_logprobs" in header else {}),
        }
    )


def _resume_key(state_key: str, settings: dict[str, Any], header: dict[str, Any]) -> str:
    """What decides the cache's bytes, shard by shard: a resumed plan with another value starts afresh."""
    return plan_key(
        {
            "state": state_key,
            "completions": header["completions"]["sha256"],
            "shard_tokens": int(settings["shard_tokens"]),
        }
    )


def _writer(settings: dict[str, Any], header: dict[str, Any], out: Path, resume: ResumeState) -> CacheWriter:
    return CacheWriter(
        out,
        layer_ids=settings["layer_ids"],
        shard_tokens=int(settings["shard_tokens"]),
        store_argmax=bool(settings["store_argmax"]),
        header=header,
        resume=resume,
        store_logprob="target_logprobs" in header,
    )


def _publish_resumed(
    settings: dict[str, Any], header: dict[str, Any], out: Path, resume: ResumeState, planned: BackendInfo
) -> Path:
    """Every shard was finished by an earlier run: publish without loading the model."""
    with _writer(settings, header, out, resume) as writer:
        for index, entry in sorted(resume.kept.items()):
            writer.adopt(index, entry)
        log.info("all %d shards were already complete; no forward needed", len(resume.plan))
        return writer.finish(
            backend={**planned.to_manifest(), "note": "no forward ran in the resuming run"}, argmax_agreement=None
        )


def _publish_reused(
    settings: dict[str, Any],
    records: list[dict[str, Any]],
    header: dict[str, Any],
    out: Path,
    resume: ResumeState,
    planned: BackendInfo,
    reuse: KeptStates,
) -> Path:
    """Every sample still to do is in the kept cache: copy them on the CPU, without the model or a server pause."""
    on_cpu = {**settings, "target": {**settings["target"], "device": "cpu"}}
    with _writer(on_cpu, header, out, resume) as writer:
        agreement = run_records(None, records, on_cpu, None, writer, resume, reuse)
        log.info(
            "all %d samples still to do were reused from %s; no forward needed", len(reuse.usable), reuse.directory
        )
        path = writer.finish(
            backend={**planned.to_manifest(), "note": f"no forward ran: states reused from {reuse.directory}"},
            argmax_agreement=agreement,
            reused_samples=len(reuse.usable),
        )
    return path


WARM_UP_TOKENS = 64  # a short first forward: long enough to reach every kernel an extraction forward runs


def warm_up(model: torch.nn.Module, records: list[dict[str, Any]], device: torch.device) -> float:
    """One short forward before the timed ones, so that Triton's compile and autotune (tens of seconds on a fresh
    machine, nothing once its cache under TRITON_CACHE_DIR is warm) are logged as what they are and kept out of
    the extraction rate. Only on CUDA: CPU kernels compile nothing. Returns the seconds it took."""
    if device.type != "cuda" or not records:
        return 0.0
    ids = (records[0]["prompt_token_ids"] + records[0]["completion_token_ids"])[:WARM_UP_TOKENS]
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids], device=device))
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    log.info(
        "kernel warm-up (a %d-token forward: Triton compiles and autotunes on a fresh machine; "
        "TRITON_CACHE_DIR keeps it for the next run) took %.1f s, apart from the extraction rate",
        len(ids),
        seconds,
    )
    return seconds


def _extract_on_device(
    settings: dict[str, Any],
    records: list[dict[str, Any]],
    header: dict[str, Any],
    out: Path,
    resume: ResumeState,
    reuse: KeptStates | None = None,
) -> Path:
    """Load the target, run the records still to do under the verified backend, publish the cache."""
    target = settings["target"]
    model, _ = load_target(target["path"], target["dtype"], target["device"])
    header["target"]["dtype"] = str(model.dtype).removeprefix("torch.")
    with (
        use_backend(target["backend"], target["device"], model) as backend,
        _writer(settings, header, out, resume) as writer,
    ):
        warm_up(model, records, torch.device(target["device"]))
        started = time.perf_counter()
        agreement = run_records(model, records, settings, backend, writer, resume, reuse)
        info = backend.verify()
        path = writer.finish(
            backend=info.to_manifest(), argmax_agreement=agreement, reused_samples=len(reuse.usable) if reuse else 0
        )
        seconds = time.perf_counter() - started
    kept = {s["id"] for index in resume.kept for s in resume.kept[index]["samples"]} | set(
        reuse.usable if reuse else ()
    )
    tokens = sum(s["length"] for s in writer.samples if s["id"] not in kept)
    log.info(
        "extracted %d tokens in %.1f s (%.0f tokens/s) with %s",
        tokens,
        seconds,
        tokens / max(seconds, 1e-9),
        info.implementation,
    )
    if agreement and agreement["tokens"]:
        log.info(
            "target argmax equals the completion token at %.2f%% of %d completion positions",
            100 * agreement["matches"] / agreement["tokens"],
            agreement["tokens"],
        )
    return path


def extract(settings: dict[str, Any], completions: str | Path, out: str | Path) -> Path:
    """The stage without argparse: check inputs, pause the server, extract, publish the cache."""
    settings = stage_settings("extract", settings)
    target = settings["target"]
    records = read_completions(completions, need_tokens=True)
    tokens = check_tokens(records, bool(settings["strict_tokens"]))
    text_config = text_config_dict(read_config_json(target["path"]))
    check_layer_ids(settings["layer_ids"], int(text_config["num_hidden_layers"]))
    _check_token_range(records, int(text_config["vocab_size"]))
    planned = select_backend(target["backend"], target["device"])  # fails here, before the server stops
    log.info("kernel backend %s will bind %s", planned.name, planned.implementation)
    header = {
        STAMP: stage_stamp("extract"),  # the code that made the cache (`dflash-eval status` reads it)
        "dataset": settings.get("dataset"),
        "target": {
            "path": str(target["path"]),
            "config_hash": target_config_hash(target["path"]),
            "model_type": text_config.get("model_type"),
            "num_hidden_layers": int(text_config["num_hidden_layers"]),
            "hidden_size": int(text_config["hidden_size"]),
            "dtype": target["dtype"],
            "last_layer": settings["last_layer"],  # capture.LAST_LAYER: what the last layer's id holds
        },
        "device": str(torch.device(target["device"])),
        "completions": completions_check.identities(completions, records),  # what evaluate checks its input by
        "token_flags": tokens.to_manifest(),
        "positions": past_positions(records, text_config, str(completions)),  # samples past the target's positions
    }
    if settings.get("target_logprobs"):  # evaluation.verify asks for the rejection scheme
        header["target_logprobs"] = {
            "convention": "dflash",
            "sampling": {i: p.as_dict() for i, p in sampling_by_id(records, completions).items()},
        }
    out = Path(out)
    plan = plan_shards([_length(r) for r in records], int(settings["shard_tokens"]))
    state_key = _state_key(settings, header)
    resume = prepare_resume(out, _resume_key(state_key, settings, header), plan, [str(r["id"]) for r in records])
    header["state_key"] = state_key  # in the manifest: what a rerun's reuse of <out>.kept/ is matched by
    if resume.complete:
        path = _publish_resumed(settings, header, out, resume, planned)
    else:
        todo = [records[i] for index in resume.todo for i in plan[index]]
        reuse = KeptStates(out, state_key, also=[_state_key(settings, header, k) for k in legacy_state_code_hashes()])
        if "target_logprobs" not in header and reuse.find(todo, bool(settings["store_argmax"])):  # (reuse copies no
            # log-probs: a cache with them is computed afresh, or resumed shard by shard)
            log.info(
                "%d of the %d samples still to do have unchanged token ids in %s: their states are copied, "
                "not computed",
                len(reuse.usable),
                len(todo),
                reuse.directory,
            )
        if len(reuse.usable) == len(todo):
            path = _publish_reused(settings, records, header, out, resume, planned, reuse)
        else:
            return _extract_with_server_paused(settings, records, header, out, resume, reuse)
    keep_published(path)
    return path


def _extract_with_server_paused(
    settings: dict[str, Any],
    records: list[dict[str, Any]],
    header: dict[str, Any],
    out: Path,
    resume: ResumeState,
    reuse: KeptStates,
) -> Path:
    """Extract with the server paused; the published cache is kept (`<out>.kept/`) before the server is
    restored, so that nothing that happens to the restore (a server that dies as it comes back, a second
    Ctrl-C, SIGTERM, SIGKILL) costs the extraction: a restore that fails is reported by server_paused and
    does not fail the job, and a job killed during the restore leaves the kept cache, which the rerun copies
    without running the target."""
    with _server_paused(settings.get("server")):
        try:
            path = _extract_on_device(settings, records, header, out, resume, reuse)
        except BaseException as error:
            # Frames in the traceback would keep the model alive on the GPU while the server restarts.
            traceback.clear_frames(error.__traceback__)
            raise
        finally:
            _release_device_memory(torch.device(settings["target"]["device"]))
        keep_published(path)
    return path


def run(args: argparse.Namespace) -> int:
    extract(settings_from_cli(args), args.completions, args.out)
    return 0
