"""ropekit inside torchtitan: caches.py (torchtitan's RoPE caches as ropekit tables and the rotation by
them; torch only) and overrides.py (the torchtitan overrides, public as ropekit.torchtitan)."""
