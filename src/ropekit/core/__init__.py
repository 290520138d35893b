"""The core: one record of every flag (pipeline.Variant), the checks, the plans, the launch, the
doors and custom ops, and the CPU path. Nothing here imports ropekit.api or ropekit.integrations."""
