"""The Tinker SDK's whole public surface on SPIRL (CPU, native engine, random tiny model).

- By introspection of the installed SDK: every public member of ServiceClient, TrainingClient,
  SamplingClient and RestClient is implemented by SPIRL's subclass or refused in one line, and the
  SDK's "future that is also the client" wrappers forward each client method (so a new SDK method
  fails here until it is handled).
- Every implemented member is called (a recorder checks that the scenario reached each one) with
  sockets blocked: nothing reaches for the network. Every refused one raises a one-line `Refused`
  that names it.
- RestClient round trip over the store: save, list, info, TTL, delete, list.
- `create_custom_loss` handle vs the same loss through `forward_backward_custom`: equal loss and
  gradients (tolerance below), and each a single training forward.
- `load_state_async` / `load_state_with_optimizer_async` restore the weights bit for bit.
- The SDK's classic sync style and async double-await style, each an unmodified script through
  `python -m spirl.tinker`, with parity on every step.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import socket
import warnings

import pytest
import torch

pytest.importorskip("tinker")

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker.lib.public_interfaces import BackcompatSamplingClientFuture, BackcompatTrainingClientFuture  # noqa: E402

from spirl.tinker import clients, process, rest  # noqa: E402
from spirl.tinker.surface import Refused, public_members, refusal_reason  # noqa: E402

from test_tinker import SCRIPTS, _datums, launch, parity_log  # noqa: E402

PAIRS = [(clients.ServiceClient, tinker.ServiceClient), (clients.TrainingClient, tinker.TrainingClient),
         (clients.SamplingClient, tinker.SamplingClient), (rest.RestClient, tinker.RestClient)]


def _implemented(ours) -> set[str]:
    return {n for n in public_members(ours.__spirl_sdk_class__) if refusal_reason(ours, n) is None}


def test_every_public_sdk_member_is_implemented_or_refused():
    counts = {}
    for ours, sdk in PAIRS:
        names = public_members(sdk)
        counts[sdk.__name__] = len(names)
        assert ours.__spirl_unhandled__ == (), f"{sdk.__name__}: SDK members neither implemented nor refused"
        assert ours.__spirl_stale_refusals__ == (), f"{sdk.__name__}: refusals of names the SDK no longer has"
        for n in names:
            owner = next(k for k in ours.__mro__ if n in vars(k))
            assert owner is ours, f"{sdk.__name__}.{n} resolves in {owner.__qualname__}, not SPIRL's class"
            reason = refusal_reason(ours, n)
            assert reason is None or (reason and "\n" not in reason)
    # the future-and-client wrappers: each client method is a forwarder (or SPIRL's own static)
    for wrapper, sdk in [(BackcompatTrainingClientFuture, tinker.TrainingClient),
                         (clients.SamplingClientFuture, tinker.SamplingClient)]:
        for n in public_members(sdk):
            owner = next(k for k in wrapper.__mro__ if n in vars(k))
            assert owner is not sdk, f"{wrapper.__name__}.{n} falls through to the SDK's {sdk.__name__}"
    assert sum(counts.values()) == 101 and counts["RestClient"] == 45, counts  # tinker 0.38.0's surface
    assert sum(len(_implemented(o)) for o, _ in PAIRS) + sum(
        len([n for n in public_members(s) if refusal_reason(o, n)]) for o, s in PAIRS) == 101


@pytest.fixture
def offline(monkeypatch):
    """Any socket connection or name lookup fails the test."""
    def refuse(*a, **k):
        raise AssertionError(f"network use: {a[:2]}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture
def api(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("SPIRL_ENGINE", "native")
    monkeypatch.setenv("SPIRL_TINKER_DIR", str(tmp_path / "tinker"))
    yield clients
    process.close()


@pytest.fixture
def recorder(monkeypatch):
    """Records which implemented public members were called."""
    called = {ours.__name__: set() for ours, _ in PAIRS}
    for ours, _ in PAIRS:
        for n in _implemented(ours):
            member = inspect.getattr_static(ours, n)
            fn = getattr(member, "__func__", member)

            def wrap(fn, key=ours.__name__, name=n):
                if inspect.iscoroutinefunction(fn):
                    async def rec(*a, **k):
                        called[key].add(name)
                        return await fn(*a, **k)
                else:
                    def rec(*a, **k):
                        called[key].add(name)
                        return fn(*a, **k)
                return rec
            monkeypatch.setattr(ours, n, staticmethod(wrap(fn)) if isinstance(member, staticmethod) else wrap(fn))
    return called


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/tokens:mean": weights.sum()}


def _masters(tc):
    return {n: p.detach().clone() for n, p in tc._s.policy.masters.items()}


def test_every_implemented_member_runs_locally_and_every_refusal_is_one_line(api, recorder, tiny_ckpt):
    warnings.simplefilter("ignore", FutureWarning)
    base = str(tiny_ckpt)
    svc = api.ServiceClient()
    svc.get_telemetry()
    assert svc.get_server_capabilities().supported_models
    tc_future = svc.create_lora_training_client(base, rank=2, seed=1)
    tc = tc_future.result()
    tok = tc.get_tokenizer()
    assert tc.get_info().lora_rank == 2 and tc.get_telemetry() is None
    sc = tc.save_weights_and_get_sampling_client().result()
    data = _datums(tok, sc)
    handle = svc.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
    base_sc = svc.create_sampling_client(base_model=base).result()
    assert base_sc.get_base_model() == base and base_sc.get_tokenizer() is tok and base_sc.get_telemetry() is None
    handle_str = sc.get_sampler_handle()
    again = api.SamplingClient.from_sampler_handle(handle_str)
    again.on_queue_state_change(None, None)
    prompt = data[0].model_input

    async def async_calls():
        assert await sc.get_base_model_async() == base
        assert await again.compute_logprobs_async(prompt) == sc.compute_logprobs(prompt).result()
        res = await sc.sample_async(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2))
        assert len(res.sequences) == 1 and res.sequences[0].sequence_id
        assert (await svc.get_server_capabilities_async()).supported_models
        await (await tc.forward_async(data, "cross_entropy"))
        await (await tc.forward_backward_async(data, "cross_entropy"))
        await (await tc.forward_backward_custom_async(data, handle))
        await (await tc.optim_step_async(types.AdamParams(learning_rate=1e-3)))
        assert (await tc.get_info_async()).model_id == tc.model_id
        await (await tc.save_weights_for_sampler_async("s-async"))
        saved = await (await tc.save_state_async("st-async"))
        await tc.save_weights_and_get_sampling_client_async()
        await tc.create_sampling_client_async(f"tinker://{tc.model_id}/sampler_weights/s-async")
        await svc.create_sampling_client_async(base_model=base)
        await (await tc.load_state_async(saved.path))
        await (await tc.load_state_with_optimizer_async(saved.path))
        return saved.path
    state_path = asyncio.run(async_calls())
    tc.forward(data, "cross_entropy").result()
    tc.forward_backward(data, "cross_entropy").result()
    tc.forward_backward_custom(data, lambda d, lps: (sum(-lp.sum() for lp in lps), {})).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler_path = tc.save_weights_for_sampler("s1", ttl_seconds=7200).result().path
    tc.create_sampling_client(sampler_path).result()
    tc.save_state("st1").result()
    tc.load_state(state_path).result()
    tc.load_state_with_optimizer(state_path).result()

    rc = svc.create_rest_client()
    run = tc.model_id
    assert rc.get_training_run(run).result().is_lora and rc.get_telemetry() is None
    assert rc.get_server_capabilities().result().supported_models
    assert rc.get_training_run_by_tinker_path(state_path).result().training_run_id == run
    assert rc.get_weights_info_by_tinker_path(state_path).result().lora_rank == 2
    assert [r.training_run_id for r in rc.list_training_runs().result().training_runs] == [run]
    assert rc.get_session(svc.session_id).result().training_run_ids == [run]
    assert svc.session_id in rc.list_sessions().result().sessions
    assert rc.get_sampler(sc.sampler_id).result().base_model == base
    rc.set_checkpoint_ttl_from_tinker_path(state_path, None).result()
    assert rc.list_user_checkpoints().result().cursor.total_count == len(rc.list_checkpoints(run).result().checkpoints)
    rc.delete_checkpoint(run, "weights/st1").result()
    rc.delete_checkpoint_from_tinker_path(sampler_path).result()

    async def rest_async():
        assert (await rc.get_training_run_async(run)).training_run_id == run
        assert (await rc.get_training_run_by_tinker_path_async(state_path)).training_run_id == run
        assert (await rc.list_training_runs_async()).training_runs
        assert (await rc.list_checkpoints_async(run)).checkpoints
        assert (await rc.list_user_checkpoints_async()).checkpoints
        await rc.set_checkpoint_ttl_from_tinker_path_async(state_path, 3600)
        assert (await rc.list_sessions_async()).sessions
        assert (await rc.get_session_async(svc.session_id)).training_run_ids
        assert (await rc.get_sampler_async(sc.sampler_id)).sampler_id == sc.sampler_id
        await rc.delete_checkpoint_async(run, "sampler_weights/s-async")
        await rc.delete_checkpoint_from_tinker_path_async(state_path)
    asyncio.run(rest_async())

    # the creators that build a new backend: one policy per process, so the previous one is closed first
    svc.close()
    tc2 = asyncio.run(svc.create_lora_training_client_async(base, rank=2))
    path = tc2.save_state("x").result().path
    svc.close()
    svc.create_training_client_from_state(path).result()
    svc.close()
    svc.create_training_client_from_state_with_optimizer(path).result()
    svc.close()
    asyncio.run(svc.create_training_client_from_state_async(path))
    svc.close()
    asyncio.run(svc.create_training_client_from_state_with_optimizer_async(path))
    svc.close()
    svc.create_full_training_client(base).result()
    svc.close()

    for ours, sdk in PAIRS:
        missing = _implemented(ours) - recorder[ours.__name__]
        assert not missing, f"{sdk.__name__}: implemented but not exercised here: {sorted(missing)}"

    # every refusal: a one-line Refused naming the method (properties refuse on access)
    targets = {clients.ServiceClient: svc, clients.TrainingClient: tc, clients.SamplingClient: sc, rest.RestClient: rc}
    refused = 0
    for ours, sdk in PAIRS:
        for n in public_members(sdk):
            if refusal_reason(ours, n) is None:
                continue
            refused += 1
            with pytest.raises(Refused) as e:
                member = getattr(targets[ours], n)
                result = member("x") if callable(member) else member
                if inspect.iscoroutine(result):
                    asyncio.run(result)
            assert f"{sdk.__name__}.{n}" in str(e.value) and "\n" not in str(e.value)
    assert refused == 101 - sum(len(_implemented(o)) for o, _ in PAIRS)


def test_classic_future_is_the_client_and_warns_like_the_sdk(api, tiny_ckpt):
    svc = api.ServiceClient()
    tc = svc.create_lora_training_client(str(tiny_ckpt), rank=2)
    assert isinstance(tc, BackcompatTrainingClientFuture)
    with pytest.warns(FutureWarning, match="Using the future as the TrainingClient is deprecated"):
        tok = tc.get_tokenizer()
    with pytest.warns(FutureWarning, match="Reading `.model_id`"):
        assert tc.model_id == tc.result().model_id
    sc = tc.result().save_weights_and_get_sampling_client()
    assert isinstance(sc, BackcompatSamplingClientFuture)
    with pytest.warns(FutureWarning, match="Using the future as the SamplingClient"):
        out = sc.sample(prompt=types.ModelInput.from_ints(tok.encode("Hi")), num_samples=1,
                        sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences) == 1
    with pytest.warns(FutureWarning, match="create_rest_client.. is deprecated"):
        svc.create_rest_client()


def test_rest_round_trip_save_list_info_ttl_delete(api, tiny_ckpt):
    svc = api.ServiceClient()
    tc = svc.create_lora_training_client(str(tiny_ckpt), rank=2, user_metadata={"who": "test"}).result()
    a = tc.save_state("a").result().path
    b = tc.save_weights_for_sampler("b").result().path
    rc = rest.RestClient()
    listed = rc.list_checkpoints(tc.model_id).result().checkpoints
    assert sorted(c.tinker_path for c in listed) == sorted([a, b])
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"} and all(c.size_bytes > 0 for c in listed)
    run = rc.get_training_run_by_tinker_path(a).result()
    assert run.is_lora and run.lora_rank == 2 and run.user_metadata == {"who": "test"}
    assert run.last_checkpoint.tinker_path == a and run.last_sampler_checkpoint.tinker_path == b
    info = rc.get_weights_info_by_tinker_path(b).result()
    assert info.is_lora and info.train_mlp and info.train_attn and info.train_unembed
    rc.set_checkpoint_ttl_from_tinker_path(a, 3600).result()
    assert next(c for c in rc.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == a).expires_at
    with pytest.raises(rest.StoreError, match="between 3600 s"):
        rc.set_checkpoint_ttl_from_tinker_path(a, 5).result()
    rc.delete_checkpoint_from_tinker_path(a).result()
    assert [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints] == [b]
    with pytest.raises(rest.StoreError, match="no checkpoint at"):
        rc.delete_checkpoint_from_tinker_path(a)
    # an expired TTL is honoured: the checkpoint is gone at the next look
    root = rest.root_dir()
    rest.write_json(root / tc.model_id / "ttl.json", {"sampler_weights/b": "2000-01-01T00:00:00+00:00"})
    assert rc.list_checkpoints(tc.model_id).result().checkpoints == []
    assert not (root / tc.model_id / "sampler_weights" / "b").exists()


def test_custom_loss_handle_equals_forward_backward_custom(api, tiny_ckpt, monkeypatch):
    """The same per-datum loss, by handle (run inside the training forward, per micro-batch) and as a
    callable over all datums: equal loss and gradients, one training forward each.
    Tolerance: 1e-6 relative. Both sum the same float32 per-datum terms; the callable sums all datums
    in one expression and the handle one datum at a time, so the order of float32 additions may differ
    (a few ulps of the sum)."""
    tc = api.ServiceClient().create_lora_training_client(str(tiny_ckpt), rank=2).result()
    svc = api.ServiceClient()
    sc = tc.save_weights_and_get_sampling_client().result()
    data = _datums(tc.get_tokenizer(), sc)
    handle = svc.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1}).result()
    forwards = []
    model = tc._s.model
    original = model.token_logprobs
    monkeypatch.setattr(model, "token_logprobs", lambda *a, **k: forwards.append(1) or original(*a, **k))

    def grads():
        g = {n: p.grad.detach().clone() for n, p in tc._s.policy.masters.items() if p.grad is not None}
        tc._s.policy.optimizer.zero_grad(set_to_none=True)
        return g

    out_h = tc.forward_backward_custom(data, handle).result()
    g_h, n_h = grads(), len(forwards)

    def as_callable(batch, logprobs_list):
        total, metrics = None, {}
        for d, lp in zip(batch, logprobs_list):
            loss, m = weighted_nll(lp, d.loss_fn_inputs["weights"].to_torch())
            total = loss if total is None else total + loss
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v.detach())
        metrics["custom/tokens:mean"] /= len(batch)
        return total, metrics
    forwards.clear()
    out_c = tc.forward_backward_custom(data, as_callable).result()
    g_c, n_c = grads(), len(forwards)
    assert n_h == n_c == len(data)  # the native engine scores one datum per forward: no extra scoring pass
    assert out_h.metrics["parity/tokens_compared:sum"] > 0 and out_h.metrics["parity/tokens_different:sum"] == 0
    for key in ("loss:sum", "custom/nll:sum", "custom/tokens:mean"):
        assert abs(out_h.metrics[key] - out_c.metrics[key]) <= 1e-6 * abs(out_c.metrics[key]), key
    assert g_h.keys() == g_c.keys() and g_h
    for n in g_h:
        scale = g_c[n].abs().max().item()
        assert (g_h[n] - g_c[n]).abs().max().item() <= 1e-6 * max(scale, 1e-12), n
    with pytest.raises(ValueError, match="has no loss_fn_inputs"):
        tc.forward_backward_custom([types.Datum(model_input=data[0].model_input, loss_fn_inputs={
            "target_tokens": data[0].loss_fn_inputs["target_tokens"]})], handle)


def test_load_state_async_restores_bit_for_bit(api, tiny_ckpt):
    tc = api.ServiceClient().create_lora_training_client(str(tiny_ckpt), rank=2).result()
    tok = tc.get_tokenizer()

    def step(seed):
        data = _datums(tok, tc.save_weights_and_get_sampling_client().result(), seed=seed)
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    step(0)
    path = tc.save_state("one").result().path
    saved = _masters(tc)
    saved_opt = {k: {s: v.clone() for s, v in st.items() if torch.is_tensor(v)}
                 for k, st in tc._s.policy.optimizer.state.items()}
    step(1)
    assert any(not torch.equal(saved[n], p) for n, p in _masters(tc).items())

    async def restore(with_optimizer):
        call = tc.load_state_with_optimizer_async if with_optimizer else tc.load_state_async
        return await (await call(path))
    for with_optimizer in (False, True):
        with pytest.warns(FutureWarning, match="load_state"):
            asyncio.run(restore(with_optimizer))
        got = _masters(tc)
        assert all(torch.equal(saved[n], got[n]) for n in saved)
    opt = tc._s.policy.optimizer.state
    assert all(torch.equal(v, opt[k][s]) for k, st in saved_opt.items() for s, v in st.items())


def test_classic_sync_script_runs_with_parity(tiny_ckpt, tmp_path):
    r = launch(tmp_path, SCRIPTS / "classic_sync.py", tiny_ckpt)
    assert r.returncode == 0 and "saved tinker://" in r.stdout
    assert "checkpoints ['sampler_weights/step0', 'sampler_weights/step1', 'weights/final']" in r.stdout
    calls = [c for c in parity_log(tmp_path) if c["backward"]]
    assert len(calls) == 2 and all(c["tokens_compared"] > 0 and c["tokens_different"] == 0 for c in calls)


@pytest.mark.slow
def test_async_double_await_script_runs_with_parity(tiny_ckpt, tmp_path):
    r = launch(tmp_path, SCRIPTS / "async_double_await.py", tiny_ckpt)
    assert r.returncode == 0 and re.search(r"^restored tinker://\S+ True True$", r.stdout, re.M)  # moved, restored
    calls = [c for c in parity_log(tmp_path) if c["backward"]]
    assert len(calls) == 3 and all(c["tokens_different"] == 0 for c in calls)
    assert calls[0]["tokens_compared"] > 0 and calls[1]["tokens_compared"] > 0  # the third trains off-policy data


def test_a_failing_script_closes_the_engine(tiny_ckpt, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys, tinker\n"
                      "tc = tinker.ServiceClient().create_lora_training_client(base_model=sys.argv[1], rank=2).result()\n"
                      "raise RuntimeError('the user script failed')\n")
    r = launch(tmp_path, script, tiny_ckpt)
    assert r.returncode != 0 and "the user script failed" in r.stderr
    assert "engine closed" in r.stdout


def test_runs_of_one_prompt_and_consecutive_seeds_go_as_one_request():
    """Session._sample on an engine that seeds children (vLLM): a group's one-sample requests become
    one request of n, split back in order; anything else (another prompt, settings, a seed gap)
    starts a new engine request. The bits are vLLM's claim, checked on the GPU
    (tests/gpu/test_tinker_gpu.py::test_one_request_of_n_is_n_requests_of_consecutive_seeds)."""
    from spirl.engines.base import Request
    from spirl.numerics.samples import Sample
    from spirl.tinker.backend import Session

    class Engine:
        seeds_children = True

        def __init__(self):
            self.calls = []

        def sample(self, reqs):
            self.calls.append(reqs)
            return [[Sample(r.prompt, [r.seed + i], torch.zeros(1)) for i in range(r.n)] for r in reqs]

    session = Session.__new__(Session)
    session.engine = Engine()
    a, b = [1, 2, 3], [4, 5]
    reqs = [Request(a, seed=10), Request(a, seed=11), Request(a, n=2, seed=12), Request(b, seed=14),
            Request(b, seed=15, temperature=0.5), Request(b, seed=17, temperature=0.5), Request(a, seed=18)]
    out = session._sample(reqs)
    sent = session.engine.calls[0]
    assert [(r.prompt, r.n, r.seed) for r in sent] == [(a, 4, 10), (b, 1, 14), (b, 1, 15), (b, 1, 17), (a, 1, 18)]
    assert [[s.completion_ids[0] for s in g] for g in out] == [[10], [11], [12, 13], [14], [15], [17], [18]]


def test_readme_table_of_the_surface_is_the_code():
    from pathlib import Path

    from spirl.tinker.surface import surface_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert surface_table([o for o, _ in PAIRS]) in readme, "README's SDK table is stale: python -m spirl.tinker --surface"


def test_requests_without_a_seed_get_streams_of_their_own():
    """A request of n samples takes seeds s..s+n-1 on vLLM (its children), so the next unseeded request starts
    after them: no sample of a session shares another's random stream; one-sample requests stay consecutive
    (merged into one request of n, above)."""
    import threading

    from spirl.tinker.backend import Session

    session = Session.__new__(Session)
    session.seed, session._sample_counter, session._lock = 3, 0, threading.Lock()
    sizes = [4, 1, 1, 8, 2]
    firsts = [session.next_seed(n) for n in sizes]
    streams = [f + i for f, n in zip(firsts, sizes) for i in range(n)]
    assert len(set(streams)) == sum(sizes)
    assert firsts[2] == firsts[1] + 1 and firsts[1] == firsts[0] + 4
