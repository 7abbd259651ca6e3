// Command driver-manager does, as a real process on the fleet's kubelet node, what
// k8s-driver-manager (the driver pod's init container) does there that the control plane can
// observe. When a driver is loaded (the driver stand-in's marker file on the node's /run/nvidia) it
// pauses the node's nvidia.com/gpu.deploy.* labels, waits until the operand pods have left the
// node, unloads the driver (removes the marker) and restores the labels; with no driver loaded it
// only restores them. The real DaemonSet controller removes and recreates the operand pods.
//
// The driver's kernel side is what it stands in for: a running pod on the node that asks for no GPU
// but gets the devices from the runtime (NVIDIA_VISIBLE_DEVICES, the nvidia RuntimeClass) keeps the
// modules in use, so the unload fails as k8s-driver-manager's does ("Could not unload NVIDIA driver
// kernel modules, driver is in use", exit 1, the operands rescheduled) and the init container
// crash-loops until that pod goes. It writes only to stderr, as k8s-driver-manager's logger does: two
// streams reach the container log in no fixed order, and the last line must be the error.
//
// With NVIDIA's DRA driver on the node (the nvidia.com/gpu.deploy.dra-driver label, GPUCluster mode) it drains
// the DRA kubelet plugin last, as k8s-driver-manager v0.12.0's evictKubeletPlugin does: the plugin unprepares
// the claims of the pods drained before it, so it refuses while a pod on the node still holds an allocated
// gpu.nvidia.com claim, and it also restarts the plugin when no driver is loaded (a plugin bound to the old
// driver root could not prepare claims against the new one).
//
// It talks to the apiserver with the pod's own service account token (the driver pod runs with
// hostNetwork). The apiserver's address is the file /etc/gpucanary/apiserver of the image:
// in-cluster config would dial the kubernetes Service's ClusterIP, which nothing here routes.
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

const (
	serviceAccount = "/var/run/secrets/kubernetes.io/serviceaccount"
	driverMarker   = "/run/nvidia/gpucanary-driver-loaded"
	nvmlState      = "/run/nvidia/gpucanary-nvml.env" // the NVML stand-in's answers while the driver is loaded
	driverRoot     = "/run/nvidia/driver"             // what NVIDIA's validator runs nvidia-smi from
	// what nvidia-smi says to the validator while a driver of the fleet's "unvalidated" fault is loaded
	validationFault = "/run/nvidia/validations/.gpucanary-nvidia-smi-fails"
	paused          = "paused-for-driver-upgrade"
	evictTimeout    = 10 * time.Minute
)

// The labels and pod apps k8s-driver-manager evicts (its GPU_OPERATOR_COMPONENTS).
var deployLabels = []string{"operator-validator", "container-toolkit", "device-plugin", "gpu-feature-discovery",
	"dcgm-exporter", "dcgm", "mig-manager", "nvsm", "sandbox-validator", "sandbox-device-plugin",
	"vgpu-device-manager", "client", "dra-validator", "dcgm-dra", "dcgm-exporter-dra"}

const (
	draDriverOperand = "dra-driver"
	draPluginApp     = "nvidia-dra-driver-kubelet-plugin"
	draDriverName    = "gpu.nvidia.com"
)

var operandApps = []string{"nvidia-operator-validator", "nvidia-container-toolkit-daemonset",
	"nvidia-device-plugin-daemonset", "gpu-feature-discovery", "nvidia-dcgm-exporter", "nvidia-dcgm",
	"nvidia-dcgm-exporter-dra", "nvidia-dcgm-dra", "nvidia-mig-manager"}

type client struct {
	base, token string
	http        *http.Client
}

func connect() (*client, error) {
	base, err := os.ReadFile("/etc/gpucanary/apiserver")
	if err != nil {
		return nil, err
	}
	token, err := os.ReadFile(serviceAccount + "/token")
	if err != nil {
		return nil, err
	}
	ca, err := os.ReadFile(serviceAccount + "/ca.crt")
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	transport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	return &client{strings.TrimSpace(string(base)), strings.TrimSpace(string(token)),
		&http.Client{Transport: transport, Timeout: 30 * time.Second}}, nil
}

func (c *client) do(method, path, contentType string, body, out any) error {
	var reader io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			return err
		}
		reader = bytes.NewReader(data)
	}
	req, err := http.NewRequest(method, c.base+path, reader)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("User-Agent", "k8s-driver-manager-stand-in")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(data))
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

type container struct {
	Env []struct {
		Name  string `json:"name"`
		Value string `json:"value"`
	} `json:"env"`
	Resources struct {
		Limits   map[string]string `json:"limits"`
		Requests map[string]string `json:"requests"`
	} `json:"resources"`
}

type object struct {
	Metadata struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		RuntimeClassName string      `json:"runtimeClassName"`
		Containers       []container `json:"containers"`
		InitContainers   []container `json:"initContainers"`
		ResourceClaims   []struct {
			Name              string `json:"name"`
			ResourceClaimName string `json:"resourceClaimName"`
		} `json:"resourceClaims"`
	} `json:"spec"`
	Status struct {
		Phase                 string `json:"phase"`
		ResourceClaimStatuses []struct {
			Name              string `json:"name"`
			ResourceClaimName string `json:"resourceClaimName"`
		} `json:"resourceClaimStatuses"`
	} `json:"status"`
}

// holdsDriver: the pod gets the GPUs from the runtime without asking the device plugin for one.
func holdsDriver(pod object) bool {
	all := append(append([]container{}, pod.Spec.InitContainers...), pod.Spec.Containers...)
	for _, c := range all {
		for key := range c.Resources.Limits {
			if strings.HasPrefix(key, "nvidia.com/gpu") || strings.HasPrefix(key, "nvidia.com/mig-") {
				return false
			}
		}
		for key := range c.Resources.Requests {
			if strings.HasPrefix(key, "nvidia.com/gpu") || strings.HasPrefix(key, "nvidia.com/mig-") {
				return false
			}
		}
	}
	if pod.Spec.RuntimeClassName == "nvidia" {
		return true
	}
	for _, c := range all {
		for _, env := range c.Env {
			value := strings.ToLower(env.Value)
			if env.Name == "NVIDIA_VISIBLE_DEVICES" && value != "" && value != "void" && value != "none" {
				return true
			}
		}
	}
	return false
}

func (c *client) driverInUse(name string) (bool, error) {
	query := url.Values{"fieldSelector": {"spec.nodeName=" + name + ",status.phase=Running"}}
	var list struct{ Items []object }
	if err := c.do("GET", "/api/v1/pods?"+query.Encode(), "", nil, &list); err != nil {
		return false, err
	}
	for _, pod := range list.Items {
		if pod.Metadata.Labels["app.kubernetes.io/component"] != "nvidia-driver" && holdsDriver(pod) {
			return true, nil
		}
	}
	return false, nil
}

func (c *client) node(name string) (object, error) {
	var node object
	err := c.do("GET", "/api/v1/nodes/"+name, "", nil, &node)
	return node, err
}

// pause is maybeSetPaused: true -> paused-for-driver-upgrade, X -> X_paused-for-driver-upgrade.
func pause(value string) string {
	if value == "" || value == "false" || strings.Contains(value, paused) {
		return value
	}
	if value == "true" {
		return paused
	}
	return value + "_" + paused
}

// restore is maybeSetTrue, the inverse of pause.
func restore(value string) string {
	if value == paused {
		return "true"
	}
	return strings.Trim(strings.ReplaceAll(value, "_"+paused, ""), "_")
}

func (c *client) setDeployLabels(name string, change func(string) string, operands ...string) error {
	node, err := c.node(name)
	if err != nil {
		return err
	}
	changed := map[string]string{}
	for _, operand := range operands {
		key := "nvidia.com/gpu.deploy." + operand
		if value, ok := node.Metadata.Labels[key]; ok && change(value) != value {
			changed[key] = change(value)
		}
	}
	if len(changed) == 0 {
		return nil
	}
	patch := map[string]any{"metadata": map[string]any{"labels": changed}}
	return c.do("PATCH", "/api/v1/nodes/"+name, "application/merge-patch+json", patch, nil)
}

func (c *client) podsOf(name string, apps []string) (int, error) {
	query := url.Values{"fieldSelector": {"spec.nodeName=" + name},
		"labelSelector": {"app in (" + strings.Join(apps, ",") + ")"}}
	var list struct{ Items []object }
	err := c.do("GET", "/api/v1/pods?"+query.Encode(), "", nil, &list)
	return len(list.Items), err
}

func (c *client) waitGone(name string, apps []string, what string) error {
	deadline := time.Now().Add(evictTimeout)
	for {
		left, err := c.podsOf(name, apps)
		if err != nil || left == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d %s pods still on %s after %s", left, what, name, evictTimeout)
		}
		time.Sleep(time.Second)
	}
}

func (c *client) draDeployed(name string) (bool, error) {
	node, err := c.node(name)
	_, ok := node.Metadata.Labels["nvidia.com/gpu.deploy."+draDriverOperand]
	return ok, err
}

// claimHolders: the pods on the node, not finished, with an allocated gpu.nvidia.com claim, where the DRA driver
// is deployed (k8s-driver-manager asks only there).
func (c *client) claimHolders(name string) ([]string, error) {
	if deployed, err := c.draDeployed(name); err != nil || !deployed {
		return nil, err
	}
	query := url.Values{"fieldSelector": {"spec.nodeName=" + name}}
	var list struct{ Items []object }
	if err := c.do("GET", "/api/v1/pods?"+query.Encode(), "", nil, &list); err != nil {
		return nil, err
	}
	var holders []string
	for _, pod := range list.Items {
		if pod.Status.Phase == "Succeeded" || pod.Status.Phase == "Failed" {
			continue
		}
		for _, ref := range pod.Spec.ResourceClaims {
			claimName := ref.ResourceClaimName
			for _, status := range pod.Status.ResourceClaimStatuses {
				if claimName == "" && status.Name == ref.Name {
					claimName = status.ResourceClaimName
				}
			}
			if claimName == "" {
				continue
			}
			var claim struct {
				Status struct {
					Allocation *struct {
						Devices struct {
							Results []struct {
								Driver string `json:"driver"`
							} `json:"results"`
						} `json:"devices"`
					} `json:"allocation"`
				} `json:"status"`
			}
			path := "/apis/resource.k8s.io/v1/namespaces/" + pod.Metadata.Namespace + "/resourceclaims/" + claimName
			if err := c.do("GET", path, "", nil, &claim); err != nil {
				if strings.Contains(err.Error(), "404") {
					continue
				}
				return nil, err
			}
			if allocation := claim.Status.Allocation; allocation != nil {
				for _, result := range allocation.Devices.Results {
					if result.Driver == draDriverName {
						holders = append(holders, pod.Metadata.Namespace+"/"+pod.Metadata.Name)
						break
					}
				}
			}
		}
	}
	return holders, nil
}

// evictKubeletPlugin pauses the DRA kubelet plugin's deploy label and waits for its pod to go.
func (c *client) evictKubeletPlugin(name string) error {
	if deployed, err := c.draDeployed(name); err != nil || !deployed {
		return err
	}
	fmt.Fprintln(os.Stderr, "draining the DRA kubelet-plugin (last, after its claim-holding clients)")
	if err := c.setDeployLabels(name, pause, draDriverOperand); err != nil {
		return err
	}
	return c.waitGone(name, []string{draPluginApp}, "DRA kubelet-plugin")
}

func driverManager(c *client, name string) error {
	if _, err := os.Stat(driverMarker); err == nil {
		fmt.Fprintln(os.Stderr, "a driver is loaded: evicting the GPU Operator's operands from", name)
		if err := c.setDeployLabels(name, pause, deployLabels...); err != nil {
			return err
		}
		if err := c.waitGone(name, operandApps, "operand"); err != nil {
			return err
		}
		holders, err := c.claimHolders(name)
		if err != nil {
			return err
		}
		if len(holders) > 0 {
			if err := c.setDeployLabels(name, restore, allOperands()...); err != nil {
				return err
			}
			return fmt.Errorf("cannot drain the DRA kubelet-plugin: pod(s) still hold GPU resource claims: %s",
				strings.Join(holders, ", "))
		}
		if err := c.evictKubeletPlugin(name); err != nil {
			return err
		}
		fmt.Fprintln(os.Stderr, "operands gone: unloading the driver")
		inUse, err := c.driverInUse(name)
		if err != nil {
			return err
		}
		if inUse {
			fmt.Fprintln(os.Stderr, "Could not unload NVIDIA driver kernel modules, driver is in use")
			fmt.Fprintln(os.Stderr, "rescheduling the GPU Operator's operands on", name)
			if err := c.setDeployLabels(name, restore, allOperands()...); err != nil {
				return err
			}
			return fmt.Errorf("failed to uninstall nvidia driver components: failed to unload driver: " +
				"resource temporarily unavailable")
		}
		for _, path := range []string{nvmlState, validationFault} {
			if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
				return err
			}
		}
		// k8s-driver-manager unmounts the driver's root here; the stand-in's root is files
		entries, err := os.ReadDir(driverRoot)
		if err != nil && !os.IsNotExist(err) {
			return err
		}
		for _, entry := range entries {
			if err := os.RemoveAll(driverRoot + "/" + entry.Name()); err != nil {
				return err
			}
		}
		if err := os.Remove(driverMarker); err != nil {
			return err
		}
	} else if err := c.evictKubeletPlugin(name); err != nil {
		return err
	}
	fmt.Fprintln(os.Stderr, "rescheduling the GPU Operator's operands on", name)
	return c.setDeployLabels(name, restore, allOperands()...)
}

func allOperands() []string {
	return append(append([]string{}, deployLabels...), draDriverOperand)
}

func main() {
	name := os.Getenv("NODE_NAME")
	c, err := connect()
	if err == nil && name == "" {
		err = fmt.Errorf("NODE_NAME is not set")
	}
	if err == nil {
		err = driverManager(c, name)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
