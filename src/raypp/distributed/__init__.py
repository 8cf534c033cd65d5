"""Process groups, their communicators, and the Ray Compiled Graph adapter."""
