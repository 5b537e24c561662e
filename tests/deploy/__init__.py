"""Offline checks of deploy/: the Dockerfile, compose.yaml and the Kubernetes manifests."""
