"""Training loops, clients of spirl.core: GRPO and the supervised warm start (warmstart.py).
Never imports spirl.tinker (tests/test_layering.py).

GRPO, `simple_rl.py`'s run, from the top:
    run.py        train(cfg) = setup(cfg), then loop(run): steps, evals, checkpoints, SIGTERM's safe stop
    setup.py      setup(cfg) -> Run: checks, model, task, policy and engine, logger; everything a step reads
    signals.py    SIGINT / SIGTERM during a run, and the one line an interrupt ends with
    trainer.py    run_step(run, step): rollout -> parity -> rewards -> advantages -> updates -> weight sync
    rollout.py    collect(run, step): the step's samples, parity and rewards, in rounds when filters drop groups
    filters.py    --filter / --dynamic-sampling's group filters, --oversample's round size
    partial.py    --partial-rollout-tokens: completions carried to the next step, their checkpoints
    ahead.py      --off-policy-steps: rollouts sampled ahead, their schedule and checkpoints
    prompts.py    where a step's prompts come from (a seeded draw, or a dataset's order) and its seeds
    update.py     one optimizer update over a mini-batch (micro-batches, the loss, the optimizer step)
    loss.py       advantages and the loss menu
    evaluation.py, precompile.py, retokenization.py, timing.py
"""
