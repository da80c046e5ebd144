"""Training on the gym's episodes with TRL's GRPOTrainer (imports torch and TRL; serving code never imports it).

`rollout.GymRollout` is the rollout_func; `reward.gym_reward` the reward function reading what it collected;
`trainer.grpo_trainer` builds the trainer on the CPU; `train_demo` runs `ngt train-demo`. The pure parts
(`episodes`, `logprob_gap`, `text_pipeline`, `weight_check`, `prompts`, `step_metrics`) need neither.
"""
