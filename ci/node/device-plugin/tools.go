//go:build tools

// Package tools pins NVIDIA's k8s-device-plugin module, whose commands ci/build-device-plugin.sh builds
// unmodified for the kubelet node: the Go module proxy serves v0.19.3 (not v0.20.0, GPU Operator v26.7.0's).
package tools

import (
	_ "github.com/NVIDIA/k8s-device-plugin/cmd/gpu-feature-discovery"
	_ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
)
