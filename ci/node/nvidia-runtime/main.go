// Command nvidia-container-runtime stands in for the NVIDIA Container Toolkit's runtime on the fleet's
// kubelet node: containerd runs the RuntimeClass "nvidia" through it instead of runc. Like the toolkit,
// it changes only `create` of a container whose environment asks for GPUs (NVIDIA_VISIBLE_DEVICES, as
// NVIDIA's images set it, other than void or none): it mounts the driver's libnvidia-ml.so.1 and
// nvidia-smi from the driver root into the container, and, where the real NVML would ask the kernel, the
// NVML stand-in's state (the directory the driver stand-in renames it into, so a reload shows). With no
// driver in the root the create fails as nvidia-container-cli's does. Every call then goes to runc.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

const (
	stateMount = "/run/gpucanary-nvml"  // where the container sees the directory of the NVML state
	stateEnv   = "GPUCANARY_NVML_STATE" // the NVML stand-in reads its state from there
)

func main() {
	nvidiaRun := os.Getenv("GPUCANARY_NVIDIA_RUN") // the node's /run/nvidia; another only in its tests
	if nvidiaRun == "" {
		nvidiaRun = "/run/nvidia"
	}
	if bundle := createBundle(os.Args[1:]); bundle != "" {
		if err := inject(filepath.Join(bundle, "config.json"), nvidiaRun); err != nil {
			fmt.Fprintf(os.Stderr, "nvidia-container-cli: initialization error: %v\n", err)
			os.Exit(1)
		}
	}
	runc, err := exec.LookPath("runc")
	if err != nil {
		fmt.Fprintln(os.Stderr, "nvidia-container-runtime: runc not found:", err)
		os.Exit(1)
	}
	if err := syscall.Exec(runc, append([]string{"runc"}, os.Args[1:]...), os.Environ()); err != nil {
		fmt.Fprintln(os.Stderr, "nvidia-container-runtime:", err)
		os.Exit(1)
	}
}

// createBundle is the bundle directory of a `runc [global flags] create --bundle DIR ID` call, else "".
func createBundle(args []string) string {
	create := false
	for i, arg := range args {
		switch {
		case arg == "create":
			create = true
		case create && (arg == "--bundle" || arg == "-b") && i+1 < len(args):
			return args[i+1]
		case create && strings.HasPrefix(arg, "--bundle="):
			return strings.TrimPrefix(arg, "--bundle=")
		}
	}
	if create {
		wd, _ := os.Getwd() // runc's own default: the bundle is the working directory
		return wd
	}
	return ""
}

// inject adds the toolkit's mounts to the OCI spec at path: the driver root's NVML and nvidia-smi where
// NVIDIA's toolkit puts them in an Ubuntu-based image, and the directory of the NVML stand-in's state, which
// the driver stand-in writes in nvidiaRun.
func inject(path, nvidiaRun string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var spec map[string]any
	if err := json.Unmarshal(raw, &spec); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	process, _ := spec["process"].(map[string]any)
	env, _ := process["env"].([]any)
	if !wantsGPUs(env) {
		return nil
	}
	root := filepath.Join(nvidiaRun, "driver")
	injected := [][2]string{
		{root + "/usr/lib64/libnvidia-ml.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"},
		{root + "/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"},
	}
	mounts, _ := spec["mounts"].([]any)
	for _, m := range injected {
		if _, err := os.Stat(m[0]); err != nil {
			return fmt.Errorf("nvml error: driver not loaded")
		}
		mounts = append(mounts, bind(m[0], m[1]))
	}
	spec["mounts"] = append(mounts, bind(nvidiaRun, stateMount))
	if lookup(env, stateEnv) == nil {
		process["env"] = append(env, stateEnv+"="+stateMount+"/gpucanary-nvml.env")
	}
	out, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o600)
}

func wantsGPUs(env []any) bool {
	v := lookup(env, "NVIDIA_VISIBLE_DEVICES")
	return v != nil && *v != "" && *v != "void" && *v != "none"
}

// lookup is the value of the first `name=` entry of env, as getenv finds it, or nil.
func lookup(env []any, name string) *string {
	for _, e := range env {
		if s, _ := e.(string); strings.HasPrefix(s, name+"=") {
			v := strings.TrimPrefix(s, name+"=")
			return &v
		}
	}
	return nil
}

func bind(source, dest string) map[string]any {
	return map[string]any{"source": source, "destination": dest, "type": "bind",
		"options": []string{"rbind", "ro", "nosuid", "nodev"}}
}
