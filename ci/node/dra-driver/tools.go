//go:build tools

// Package tools pins the module of NVIDIA's DRA driver for GPUs (sigs.k8s.io/dra-driver-nvidia-gpu), whose GPU
// kubelet plugin build-dra-driver.sh builds unmodified, and the NVIDIA Container Toolkit version it requires, whose
// nvidia-cdi-hook the plugin's image carries; go.mod's replace directives stand in for the two
// modules the Go module proxy does not serve (k8s.io/kubernetes v1.37.0-rc.0, github.com/NVIDIA/go-nvfm).
package tools

import (
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook"
	_ "sigs.k8s.io/dra-driver-nvidia-gpu/cmd/gpu-kubelet-plugin"
)
