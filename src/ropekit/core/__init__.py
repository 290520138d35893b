"""The core: the one record of every flag (variant), the checks (checks, with rules, aliasing, forms,
strict), the doors and custom ops (dispatch), the run step (run), the plans and the launch, and
the CPU path. Nothing here imports ropekit.api or ropekit.integrations."""
