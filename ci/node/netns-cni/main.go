// Command gpucanary-netns is a CNI plugin that stands in for a cluster's pod network (bridge,
// Calico, Cilium ...) on the fleet's kubelet node, where no pod may reach anything but itself.
// containerd's CRI refuses a sandbox whose CNI result has no eth0 with an address, and the stock
// loopback plugin reports only lo. So on ADD this plugin brings lo up and creates a veth pair whose
// both ends stay inside the pod's own network namespace: eth0 gets one /32 address from "subnet"
// (allocated with one file per address under "dataDir", as host-local does), and nothing is linked
// to the host, routed, bridged or NATed. DEL releases the address; the namespace takes the links
// with it. It needs nsenter (util-linux) and ip (iproute2).
//
// With "apiServer" in its config it also stands in for kube-proxy's rule for the kubernetes Service,
// which pods that use in-cluster config dial (NVIDIA's DRA kubelet plugin and the validator in its
// init container): the Service's ClusterIP goes on the pod's lo, and a forwarder process listens
// there, inside the pod's namespace, and carries each connection to the apiserver on the machine's
// 127.0.0.1. No address or route of the machine changes; DEL stops the forwarder.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

type netConf struct {
	CNIVersion string `json:"cniVersion"`
	Name       string `json:"name"`
	Subnet     string `json:"subnet"`
	DataDir    string `json:"dataDir"`
	APIServer  *struct {
		Service  string `json:"service"`  // ClusterIP:port of the kubernetes Service
		Upstream string `json:"upstream"` // the apiserver's 127.0.0.1:port
	} `json:"apiServer"`
}

func fail(version string, err error) {
	json.NewEncoder(os.Stdout).Encode(map[string]any{"cniVersion": version, "code": 999, "msg": err.Error()})
	os.Exit(1)
}

func inNetns(netns string, args ...string) error {
	out, err := exec.Command("nsenter", append([]string{"--net=" + netns, "--", "ip"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// allocate returns the address already held by this container, or claims the first free one.
func allocate(conf netConf, id string) (net.IP, error) {
	_, subnet, err := net.ParseCIDR(conf.Subnet)
	if err != nil {
		return nil, fmt.Errorf("subnet %q: %w", conf.Subnet, err)
	}
	dir := filepath.Join(conf.DataDir, conf.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	base := subnet.IP.To4()
	ones, bits := subnet.Mask.Size()
	for host := 2; host < (1<<(bits-ones))-1; host++ {
		ip := net.IPv4(base[0], base[1], base[2]+byte(host>>8), base[3]+byte(host&0xff)).To4()
		path := filepath.Join(dir, ip.String())
		if held, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(held)) == id {
			return ip, nil
		}
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if errors.Is(err, os.ErrExist) {
			continue
		} else if err != nil {
			return nil, err
		}
		fmt.Fprintln(f, id)
		return ip, f.Close()
	}
	return nil, fmt.Errorf("no free address in %s", conf.Subnet)
}

func release(conf netConf, id string) {
	paths, _ := filepath.Glob(filepath.Join(conf.DataDir, conf.Name, "*"))
	for _, path := range paths {
		if held, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(held)) == id {
			os.Remove(path)
		}
	}
}

func add(conf netConf, id, netns, ifname string) {
	ip, err := allocate(conf, id)
	if err != nil {
		fail(conf.CNIVersion, err)
	}
	peer := ifname + "-peer"
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", ifname, "type", "veth", "peer", "name", peer},
		{"addr", "add", ip.String() + "/32", "dev", ifname},
		{"link", "set", peer, "up"},
		{"link", "set", ifname, "up"},
	} {
		if err := inNetns(netns, args...); err != nil {
			release(conf, id)
			fail(conf.CNIVersion, err)
		}
	}
	if conf.APIServer != nil {
		if err := startForwarder(conf, id, netns); err != nil {
			release(conf, id)
			fail(conf.CNIVersion, err)
		}
	}
	json.NewEncoder(os.Stdout).Encode(map[string]any{
		"cniVersion": conf.CNIVersion,
		"interfaces": []map[string]string{{"name": ifname, "sandbox": netns}},
		"ips":        []map[string]any{{"address": ip.String() + "/32", "interface": 0}},
	})
}

func main() {
	if len(os.Args) == 5 && os.Args[1] == "forward" {
		if err := forward(os.Args[2], os.Args[3], os.Args[4]); err != nil {
			fmt.Fprintln(os.Stderr, "forward:", err)
			os.Exit(1)
		}
		return
	}
	raw, _ := io.ReadAll(os.Stdin)
	var conf netConf
	if os.Getenv("CNI_COMMAND") != "VERSION" {
		if err := json.Unmarshal(raw, &conf); err != nil {
			fail("1.0.0", fmt.Errorf("config: %w", err))
		}
	}
	id, netns, ifname := os.Getenv("CNI_CONTAINERID"), os.Getenv("CNI_NETNS"), os.Getenv("CNI_IFNAME")
	switch os.Getenv("CNI_COMMAND") {
	case "ADD":
		add(conf, id, netns, ifname)
	case "DEL":
		if netns != "" {
			_ = inNetns(netns, "link", "del", ifname) // gone already when the namespace was
		}
		stopForwarder(conf, id)
		release(conf, id)
	case "VERSION":
		fmt.Println(`{"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0"]}`)
	}
}
