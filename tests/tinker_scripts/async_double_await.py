"""A Tinker script in the SDK's async style: `await` each creator, then the "double await" of
training calls (`future = await tc.forward_backward_async(...)`, then `await future`), `result_async()`,
and `load_state_with_optimizer_async`. No SPIRL imports.

    python -m spirl.tinker async_double_await.py MODEL_DIR
"""
import asyncio
import sys

import tinker
from tinker import types


async def main(base_model: str) -> None:
    service_client = tinker.ServiceClient()
    training_client = await service_client.create_lora_training_client(base_model=base_model, rank=4)
    tokenizer = training_client.get_tokenizer()
    prompts = [tokenizer.encode(f"Count to {n}:") for n in (3, 5)]
    for step in range(2):
        sampling_client = await training_client.save_weights_and_get_sampling_client()
        results = await asyncio.gather(*[
            sampling_client.sample_async(prompt=types.ModelInput.from_ints(p), num_samples=2,
                                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0))
            for p in prompts])
        data = []
        for p, res in zip(prompts, results):
            for i, seq in enumerate(res.sequences):
                full = p + list(seq.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (len(p) - 1) + list(seq.logprobs),
                                    "advantages": [0.0] * (len(p) - 1) + [0.5 - i] * len(seq.tokens)}))
        fwd_bwd_future = await training_client.forward_backward_async(data, "ppo")
        optim_future = await training_client.optim_step_async(types.AdamParams(learning_rate=1e-2))
        fwd_bwd = await fwd_bwd_future
        optim = await optim_future.result_async()
        print("step", step, fwd_bwd.metrics, optim.metrics)
    saved = await (await training_client.save_state_async("two"))
    before = await training_client.save_weights_and_get_sampling_client()
    probe = types.ModelInput.from_ints(prompts[0])
    expected = await before.compute_logprobs_async(probe)
    await (await training_client.forward_backward_async(data, "ppo"))  # one more step moves the weights ...
    await (await training_client.optim_step_async(types.AdamParams(learning_rate=1e-2)))
    moved = await training_client.save_weights_and_get_sampling_client()
    changed = (await moved.compute_logprobs_async(probe)) != expected
    await (await training_client.load_state_with_optimizer_async(saved.path))  # ... and the state brings them back
    restored = await training_client.save_weights_and_get_sampling_client()
    print("restored", saved.path, changed, (await restored.compute_logprobs_async(probe)) == expected)


asyncio.run(main(sys.argv[1]))
