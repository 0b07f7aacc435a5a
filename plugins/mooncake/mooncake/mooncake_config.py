"""``mooncake.mooncake_config`` served by tidekv: ``tidekv.compat.mooncake_config``'s names."""

from tidekv.compat.mooncake_config import DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE, MooncakeConfig

__all__ = ["DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE", "MooncakeConfig"]
