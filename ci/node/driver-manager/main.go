// Command driver-manager does, as a real process on the fleet's kubelet node, what
// k8s-driver-manager (the driver pod's init container) does there that the control plane can
// observe. When a driver is loaded (the driver stand-in's marker file on the node's /run/nvidia) it
// pauses the node's nvidia.com/gpu.deploy.* labels, waits until the operand pods have left the
// node, unloads the driver (removes the marker) and restores the labels; with no driver loaded it
// only restores them. The real DaemonSet controller removes and recreates the operand pods.
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
	paused         = "paused-for-driver-upgrade"
	evictTimeout   = 10 * time.Minute
)

// The labels and pod apps k8s-driver-manager evicts (its GPU_OPERATOR_COMPONENTS).
var deployLabels = []string{"operator-validator", "container-toolkit", "device-plugin", "gpu-feature-discovery",
	"dcgm-exporter", "dcgm", "mig-manager", "nvsm", "sandbox-validator", "sandbox-device-plugin",
	"vgpu-device-manager", "client", "dra-validator", "dcgm-dra", "dcgm-exporter-dra"}
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

type object struct {
	Metadata struct {
		Name   string            `json:"name"`
		Labels map[string]string `json:"labels"`
	} `json:"metadata"`
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

func (c *client) setDeployLabels(name string, change func(string) string) error {
	node, err := c.node(name)
	if err != nil {
		return err
	}
	changed := map[string]string{}
	for _, operand := range deployLabels {
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

func (c *client) operandPods(name string) (int, error) {
	query := url.Values{"fieldSelector": {"spec.nodeName=" + name},
		"labelSelector": {"app in (" + strings.Join(operandApps, ",") + ")"}}
	var list struct{ Items []object }
	err := c.do("GET", "/api/v1/pods?"+query.Encode(), "", nil, &list)
	return len(list.Items), err
}

func driverManager(c *client, name string) error {
	if _, err := os.Stat(driverMarker); err == nil {
		fmt.Println("a driver is loaded: evicting the GPU Operator's operands from", name)
		if err := c.setDeployLabels(name, pause); err != nil {
			return err
		}
		deadline := time.Now().Add(evictTimeout)
		for {
			left, err := c.operandPods(name)
			if err != nil {
				return err
			}
			if left == 0 {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%d operand pods still on %s after %s", left, name, evictTimeout)
			}
			time.Sleep(time.Second)
		}
		fmt.Println("operands gone: unloading the driver")
		if err := os.Remove(driverMarker); err != nil {
			return err
		}
	}
	fmt.Println("rescheduling the GPU Operator's operands on", name)
	return c.setDeployLabels(name, restore)
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
