"""The built-in fake provider and the narrated demo: never imported by `serve`."""
