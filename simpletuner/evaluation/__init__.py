"""What a run shows while it trains: validation images, live previews, CLIP scores, eval loss, trackers.

- ``prompts``: the validation prompt list (``validation_prompt`` + ``user_prompt_library``).
- ``validation``: images from the family's diffusers pipeline built around the training transformer, with
  Tiny-AutoEncoder previews; ``inference_mode`` / ``preserve_rng_state`` keep training untouched.
- ``clip_score``: CLIP score of an image against its prompt (and the tiny CLIP used by tests).
- ``eval_loss``: flow-matching loss at fixed noise levels with fixed noise, on ``dataset_type: eval`` datasets.
- ``trackers``: wandb and TensorBoard.
- ``evaluator``: the one object the training loop talks to (``on_start`` / ``on_step`` / ``on_end``).
"""
