"""A plain Tinker SDK RL loop in the style of Tinker's RL quick start: no cookbook, no SPIRL imports.

    python -m spirl.tinker rl_quickstart.py MODEL_DIR
"""
import sys
import tinker
from tinker import types

base = sys.argv[1]
service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model=base, rank=4).result()
tok = training.get_tokenizer()
prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False) for a, b in [(1, 2), (3, 4)]]
for step in range(2):
    sampler = training.save_weights_and_get_sampling_client().result()
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(tok.encode(p)), num_samples=4,
                              sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, stop=["\n"]))
               for p in prompts]
    datums = []
    for p, f in zip(prompts, futures):
        ids = tok.encode(p)
        seqs = f.result().sequences
        rewards = [float(len(s.tokens) % 2) for s in seqs]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(seqs, rewards):
            full = ids + s.tokens
            n = len(full) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": [0.0] * (len(ids) - 1) + s.logprobs,
                "advantages": [0.0] * (len(ids) - 1) + [r - mean] * len(s.tokens)}))
    out = training.forward_backward(datums, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    print("step", step, {k: v for k, v in out.metrics.items()})
print("saved", training.save_state("final").result().path)
