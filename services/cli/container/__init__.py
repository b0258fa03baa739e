"""A small container runtime for `vgpu run`: namespaces, mounts and credentials (Linux only)."""
