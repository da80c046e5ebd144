"""Training on the gym's episodes with TRL's GRPOTrainer (imports torch and TRL; serving code never imports it).

`rollout.GymRollout` is the rollout_func; `reward.gym_reward` the reward function reading what it collected;
`trainer.grpo_trainer` builds the trainer on the CPU (a `corrected_trainer.CorrectedGRPOTrainer`, whose loss takes
the rollout's token weights); `ahead.AheadCollector` collects ahead of the trainer; `train_demo` runs
`ngt train-demo` and `staleness_table` `ngt train-async`. The pure parts (`episodes`, `logprob_gap`, `text_pipeline`,
`weight_check`, `staleness`, `correction`, `prompts`, `step_metrics`) need neither.
"""
