"""non_ascii: short multi-turn writing whose reward is the share of the answers' characters beyond ASCII."""
