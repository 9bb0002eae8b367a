"""Pure planning: layout, shards, parameter counts, memory, schedules. No torch, no I/O."""
