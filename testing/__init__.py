"""Test support shared by the test suite, the benchmarks and the fault suite: real servers
started on free loopback ports in temp dirs (Redis, Redis Cluster and Sentinel, PostgreSQL),
tiny random models saved like real ones, and HTTP clients of Gradio's API and the Open
Inference Protocol. Nothing here is imported by the app.
"""
