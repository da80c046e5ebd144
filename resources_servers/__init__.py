"""Resources servers (environments): one folder per environment."""
