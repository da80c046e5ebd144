"""The simple agent: one model, one environment, tool calls and user turns until done."""
