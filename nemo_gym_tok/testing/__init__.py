"""Test harnesses: random-weight tiny models and the real chat-template catalog; runtime code never imports them."""
