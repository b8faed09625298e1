"""A Tinker script in the SDK's classic synchronous style: the creators' return values used directly
as clients (no .result() on them), as older Tinker examples and many users' scripts do. No SPIRL
imports.

    python -m spirl.tinker classic_sync.py MODEL_DIR
"""
import sys

import tinker
from tinker import types

service_client = tinker.ServiceClient()
training_client = service_client.create_lora_training_client(base_model=sys.argv[1], rank=4)
tokenizer = training_client.get_tokenizer()
print("info", training_client.get_info().lora_rank, training_client.model_id)
prompt_ids = tokenizer.encode("The capital of France is")
for step in range(2):
    sampling_client = training_client.save_weights_and_get_sampling_client(name=f"step{step}")
    result = sampling_client.sample(prompt=types.ModelInput.from_ints(prompt_ids), num_samples=4,
                                    sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0)).result()
    data = []
    for i, seq in enumerate(result.sequences):
        full = prompt_ids + list(seq.tokens)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:],
                            "logprobs": [0.0] * (len(prompt_ids) - 1) + list(seq.logprobs),
                            "advantages": [0.0] * (len(prompt_ids) - 1) + [1.0 if i % 2 else -1.0] * len(seq.tokens)}))
    fwd_bwd = training_client.forward_backward(data, "importance_sampling")
    optim = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
    print("step", step, fwd_bwd.result().metrics, optim.result().metrics)
print("saved", training_client.save_state("final").result().path)
rest_client = service_client.create_rest_client()
print("checkpoints", [c.checkpoint_id for c in rest_client.list_checkpoints(training_client.model_id).result().checkpoints])
