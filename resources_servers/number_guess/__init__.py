"""number_guess: a multi-turn guessing game played through user turns, without tools."""
