"""Tinker's RestClient over what the local backend has on disk (SPIRL_TINKER_DIR), as the SDK's types.

Layout under the root (written by spirl/tinker/clients.py):

    <root>/<run>/run.json                      a training run: base model, LoRA, seed, user metadata
    <root>/<run>/weights/<name>/               save_state (state.json inside)
    <root>/<run>/sampler_weights/<name>/       save_weights_for_sampler (sampler.json inside)
    <root>/<run>/ttl.json                      checkpoint id -> expiry (ISO 8601, UTC)
    <root>/sessions/<session>.json             a ServiceClient's session: its runs and samplers

A checkpoint's `tinker://<run>/<kind>/<name>` path is that directory. Its time is the directory's
modification time (checkpoint files hold no wall-clock time, so equal states give equal bytes).
TTLs are honoured: expired checkpoints are deleted before any RestClient call reads the store and
when a backend starts. Methods with no local meaning (billing, the web console's audit log and
trace export, projects, publishing to the hosted registry, signed download URLs, whoami) are
refused in one line (`REFUSED`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import tinker
from tinker import types

from . import process
from .surface import done_future, forward_sync, sdk_surface

log = logging.getLogger("spirl.tinker")

KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""Path segment -> Tinker's checkpoint_type, for the kinds the local backend writes."""
MIN_TTL, MAX_TTL = 3600, 10 * 365 * 24 * 3600
"""The SDK's documented TTL range: 1 hour to 10 years."""


class StoreError(ValueError):
    """A request about checkpoints or runs that the store cannot answer (one line)."""


def root_dir() -> Path:
    from .backend import BackendConfig

    return Path(BackendConfig.from_env().root)


def write_json(path: Path, obj: dict) -> None:
    """Atomically (a crash leaves the old file or the new one, never half of one); sorted keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj, sort_keys=True, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if default is not None:
            return default
        raise


def record_run(root: Path, run_id: str, meta: dict) -> None:
    write_json(root / run_id / "run.json", {"training_run_id": run_id, **meta})


def record_session(root: Path, session_id: str, *, run_id: str | None = None, sampler_id: str | None = None,
                   user_metadata: dict | None = None) -> None:
    """Add a training run or a sampler to a session's record (created on first use)."""
    path = root / "sessions" / f"{session_id}.json"
    rec = read_json(path, {"session_id": session_id, "training_run_ids": [], "sampler_ids": [],
                           "user_metadata": dict(user_metadata or {})})
    if run_id and run_id not in rec["training_run_ids"]:
        rec["training_run_ids"].append(run_id)
    if sampler_id and sampler_id not in rec["sampler_ids"]:
        rec["sampler_ids"].append(sampler_id)
    write_json(path, rec)


def parse(tinker_path: str) -> types.ParsedCheckpointTinkerPath:
    try:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    except ValueError:
        raise StoreError(f"{tinker_path!r} is not a checkpoint path: use tinker://<run>/weights/<name> or "
                         "tinker://<run>/sampler_weights/<name>") from None
    if parsed.checkpoint_type == "external":
        raise StoreError(f"{tinker_path}: external weights are not written by SPIRL's local backend")
    return parsed


def checkpoint_dir(root: Path, tinker_path: str) -> Path:
    parsed = parse(tinker_path)
    return root / parsed.training_run_id / parsed.checkpoint_id


def set_ttl(root: Path, tinker_path: str, ttl_seconds: int | None) -> None:
    """Expire the checkpoint `ttl_seconds` from now (None: never), as the SDK's TTL calls do."""
    if ttl_seconds is not None and not MIN_TTL <= ttl_seconds <= MAX_TTL:
        raise StoreError(f"ttl_seconds={ttl_seconds}: a TTL is between {MIN_TTL} s (1 hour) and {MAX_TTL} s (10 years), "
                         "or None for no expiry")
    parsed = parse(tinker_path)
    if not (root / parsed.training_run_id / parsed.checkpoint_id).is_dir():
        raise StoreError(f"no checkpoint at {tinker_path}")
    path = root / parsed.training_run_id / "ttl.json"
    ttls = read_json(path, {})
    if ttl_seconds is None:
        ttls.pop(parsed.checkpoint_id, None)
    else:
        ttls[parsed.checkpoint_id] = (datetime.now(timezone.utc) + timedelta(seconds=ttl_seconds)).isoformat()
    write_json(path, ttls)


def sweep_expired(root: Path) -> list[str]:
    """Delete every checkpoint whose TTL has passed; returns their tinker paths."""
    now, gone = datetime.now(timezone.utc), []
    for ttl_file in sorted(root.glob("*/ttl.json")):
        ttls = read_json(ttl_file, {})
        expired = [cid for cid, at in ttls.items() if datetime.fromisoformat(at) <= now]
        for cid in expired:
            shutil.rmtree(ttl_file.parent / cid, ignore_errors=True)
            gone.append(f"tinker://{ttl_file.parent.name}/{cid}")
            del ttls[cid]
        if expired:
            write_json(ttl_file, ttls)
    if gone:
        log.info("deleted %d expired checkpoint(s): %s", len(gone), ", ".join(gone))
    return gone


def _mtime(path: Path) -> datetime:
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)


def _run(root: Path, run_id: str) -> dict:
    try:
        return read_json(root / run_id / "run.json")
    except FileNotFoundError:
        raise StoreError(f"no training run {run_id!r} under {root}") from None


def _checkpoints(root: Path, run_id: str, run_meta: dict) -> list[types.Checkpoint]:
    """The run's checkpoints, oldest first; `run_meta` is its run.json (the fallback user metadata)."""
    ttls = read_json(root / run_id / "ttl.json", {})
    out = []
    for segment, kind in KINDS.items():
        for d in sorted((root / run_id / segment).glob("*")):
            if not d.is_dir() or d.name.startswith("."):
                continue
            cid = f"{segment}/{d.name}"
            meta = read_json(d / ("state.json" if segment == "weights" else "sampler.json"), {})
            expires = ttls.get(cid)
            out.append(types.Checkpoint(
                checkpoint_id=cid, checkpoint_type=kind, time=_mtime(d), tinker_path=f"tinker://{run_id}/{cid}",
                size_bytes=sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
                user_metadata=meta.get("user_metadata") or run_meta.get("user_metadata") or None,
                expires_at=datetime.fromisoformat(expires) if expires else None))
    return sorted(out, key=lambda c: (c.time, c.checkpoint_id))


def _training_run(root: Path, run_id: str) -> types.TrainingRun:
    meta = _run(root, run_id)
    lora = meta.get("lora") or {}
    ckpts = _checkpoints(root, run_id, meta)
    last = {kind: next((c for c in reversed(ckpts) if c.checkpoint_type == kind), None) for kind in KINDS.values()}
    times = [_mtime(root / run_id / "run.json")] + [c.time for c in ckpts]
    return types.TrainingRun(training_run_id=run_id, base_model=meta["base_model"], model_owner="local",
                             is_lora=bool(lora), lora_rank=lora.get("rank"), last_request_time=max(times),
                             last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"],
                             user_metadata=meta.get("user_metadata") or None)


def _run_ids(root: Path) -> list[str]:
    """Training runs, newest first."""
    runs = [p.parent for p in root.glob("*/run.json")]
    return [p.name for p in sorted(runs, key=lambda p: (_mtime(p / "run.json"), p.name), reverse=True)]


def _page(items: list, limit: int, offset: int) -> tuple[list, types.Cursor]:
    if limit < 1 or offset < 0:
        raise StoreError(f"limit={limit}, offset={offset}: limit must be >= 1 and offset >= 0")
    return items[offset:offset + limit], types.Cursor(offset=offset, limit=limit, total_count=len(items))


REFUSED = {
    "get_billing_usage": "billing belongs to the hosted service; a local run has no bill",
    "get_current_checkpoint_storage_usage": "storage billing belongs to the hosted service (checkpoint sizes are in "
                                            "list_checkpoints' size_bytes)",
    "get_audit_log": "the audit log is the hosted service's record of account events; the local store keeps none",
    "export_session_trace": "session traces are recorded by the hosted service",
    "assign_session_project": "projects belong to the hosted service",
    "copy_weights": "copies between projects of the hosted service; the local store has no projects (copy the "
                    "checkpoint directory under SPIRL_TINKER_DIR)",
    "get_external_weights_urls": "signed download URLs belong to the hosted service; local checkpoints are already "
                                 "files under SPIRL_TINKER_DIR",
    "publish_checkpoint_from_tinker_path": "publishing is to the hosted service's registry",
    "unpublish_checkpoint_from_tinker_path": "publishing is to the hosted service's registry",
    "search_sessions": "an experimental search of the hosted service's sessions (use list_sessions / get_session)",
    "whoami": "the local backend has no accounts or credentials",
}
REFUSED.update({f"{name}_async": reason for name, reason in list(REFUSED.items())
                if name not in ("search_sessions", "whoami")})


@sdk_surface(tinker.RestClient, REFUSED)
class RestClient(tinker.RestClient):
    """Training runs, checkpoints (list, info, delete, TTL), weights info and sessions of the local
    store under SPIRL_TINKER_DIR, as the SDK's types. Every method returns what the SDK's does: a
    future (`.result()`, `await`); its `_async` twin the value."""

    def __init__(self, *args, **kwargs):  # noqa: D107 - arguments of the hosted service are ignored
        self._root = root_dir()

    def _store(self) -> Path:
        sweep_expired(self._root)
        return self._root

    # training runs
    def get_training_run(self, training_run_id, access_scope="owned"):
        return done_future(_training_run(self._store(), training_run_id))

    def get_training_run_by_tinker_path(self, tinker_path, access_scope="owned"):
        root = self._store()
        if not checkpoint_dir(root, tinker_path).is_dir():
            raise StoreError(f"no checkpoint at {tinker_path} ({checkpoint_dir(root, tinker_path)})")
        return done_future(_training_run(root, parse(tinker_path).training_run_id))

    def list_training_runs(self, limit=20, offset=0, access_scope="owned", project_id=None):
        root = self._store()
        ids, cursor = _page(_run_ids(root), limit, offset)
        return done_future(types.TrainingRunsResponse(training_runs=[_training_run(root, r) for r in ids], cursor=cursor))

    # checkpoints
    def list_checkpoints(self, training_run_id):
        root = self._store()
        checkpoints = _checkpoints(root, training_run_id, _run(root, training_run_id))
        return done_future(types.CheckpointsListResponse(checkpoints=checkpoints))

    def list_user_checkpoints(self, limit=100, offset=0):
        root = self._store()
        every = sorted((c for r in _run_ids(root) for c in _checkpoints(root, r, _run(root, r))),
                       key=lambda c: (c.time, c.tinker_path), reverse=True)
        page, cursor = _page(every, limit, offset)
        return done_future(types.CheckpointsListResponse(checkpoints=page, cursor=cursor))

    def delete_checkpoint(self, training_run_id, checkpoint_id):
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path):
        root = self._store()
        directory = checkpoint_dir(root, tinker_path)
        if not directory.is_dir():
            raise StoreError(f"no checkpoint at {tinker_path} ({directory})")
        shutil.rmtree(directory)
        ttl_file = directory.parent.parent / "ttl.json"
        ttls = read_json(ttl_file, {})
        if ttls.pop(parse(tinker_path).checkpoint_id, None) is not None:
            write_json(ttl_file, ttls)
        return done_future(None)

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path, ttl_seconds):
        set_ttl(self._store(), tinker_path, ttl_seconds)
        return done_future(None)

    def get_weights_info_by_tinker_path(self, tinker_path):
        root = self._store()
        directory = checkpoint_dir(root, tinker_path)
        meta_file = next((directory / f for f in ("state.json", "sampler.json") if (directory / f).is_file()), None)
        if meta_file is None:
            raise StoreError(f"no checkpoint at {tinker_path} ({directory})")
        meta = read_json(meta_file)
        lora = meta.get("lora") or {}
        targets = set(lora.get("targets", ()))
        return done_future(types.WeightsInfoResponse(
            base_model=meta["base_model"], is_lora=bool(lora), lora_rank=lora.get("rank"),
            train_unembed="lm_head" in targets if lora else None,
            train_mlp=bool(targets & {"gate_proj", "up_proj", "down_proj"}) if lora else None,
            train_attn=bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"}) if lora else None))

    # sessions and samplers
    def list_sessions(self, limit=20, offset=0, access_scope="owned"):
        files = sorted((self._store() / "sessions").glob("*.json"), key=lambda p: (_mtime(p), p.name), reverse=True)
        page, _ = _page([p.stem for p in files], limit, offset)
        return done_future(types.ListSessionsResponse(sessions=page))

    def get_session(self, session_id, access_scope="owned"):
        try:
            rec = read_json(self._store() / "sessions" / f"{session_id}.json")
        except FileNotFoundError:
            raise StoreError(f"no session {session_id!r} under {self._root}") from None
        return done_future(types.GetSessionResponse(training_run_ids=rec["training_run_ids"], sampler_ids=rec["sampler_ids"],
                                              user_metadata=rec.get("user_metadata") or None))

    def get_sampler(self, sampler_id):
        s = process.live_sampler(sampler_id)
        return done_future(types.GetSamplerResponse(sampler_id=sampler_id, base_model=s.get_base_model(),
                                              model_path=s.model_path))

    def get_server_capabilities(self):
        return done_future(process.server_capabilities())

    def get_telemetry(self):
        return None

    # the SDK's async twins return the value
    get_training_run_async = forward_sync("get_training_run_async")
    get_training_run_by_tinker_path_async = forward_sync("get_training_run_by_tinker_path_async")
    list_training_runs_async = forward_sync("list_training_runs_async")
    list_checkpoints_async = forward_sync("list_checkpoints_async")
    list_user_checkpoints_async = forward_sync("list_user_checkpoints_async")
    delete_checkpoint_async = forward_sync("delete_checkpoint_async")
    delete_checkpoint_from_tinker_path_async = forward_sync("delete_checkpoint_from_tinker_path_async")
    set_checkpoint_ttl_from_tinker_path_async = forward_sync("set_checkpoint_ttl_from_tinker_path_async")
    list_sessions_async = forward_sync("list_sessions_async")
    get_session_async = forward_sync("get_session_async")
    get_sampler_async = forward_sync("get_sampler_async")
