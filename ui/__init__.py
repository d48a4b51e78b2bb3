"""Gradio layout and callbacks only: they call the engine and hold no business logic."""
