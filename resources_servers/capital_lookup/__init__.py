"""capital_lookup: answer "what is the capital of X?" with the help of one lookup tool."""
