// Command fake-gpu-plugin stands in for NVIDIA's k8s-device-plugin (nvcr.io/nvidia/k8s-device-plugin)
// on the fleet's kubelet node, which has no GPUs. It speaks the real device-plugin API
// (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1): it serves a socket in the kubelet's device-plugin
// directory, registers it with kubelet.sock for nvidia.com/gpu, advertises --count healthy devices
// through ListAndWatch and, like the real plugin's envvar strategy, answers Allocate with
// NVIDIA_VISIBLE_DEVICES set to the allocated device IDs. When the kubelet restarts it wipes the
// directory and recreates kubelet.sock; the plugin notices and registers again, as the real one does.
// What it cannot do is what needs hardware: no device nodes, no health checks, no MIG, no CDI.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices     []*pluginapi.Device
	allocations *os.File
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the devices never change: no hardware to fail
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, container := range req.ContainerRequests {
		ids := strings.Join(container.DevicesIds, ",")
		log.Printf("Allocate [%s]", ids)
		fmt.Fprintf(p.allocations, "%d %s\n", time.Now().UnixNano(), ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": ids},
		})
	}
	return resp, nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func inode(path string) uint64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Ino
}

// serve listens on the plugin socket and registers it; it returns once the kubelet socket or the
// plugin socket is replaced or removed (a kubelet restart), so the caller starts over.
func serve(p *plugin, dir, endpoint, resource string, registered *atomic.Bool) error {
	socket := filepath.Join(dir, endpoint)
	kubelet := filepath.Join(dir, "kubelet.sock")
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go server.Serve(listener)
	defer server.Stop()
	kubeletInode := inode(kubelet)
	conn, err := grpc.NewClient("unix://"+kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
	})
	cancel()
	conn.Close()
	if err != nil {
		return fmt.Errorf("register with %s: %w", kubelet, err)
	}
	log.Printf("registered %s as %s with %d devices", endpoint, resource, len(p.devices))
	registered.Store(true)
	defer registered.Store(false)
	pluginInode := inode(socket)
	for {
		time.Sleep(time.Second)
		if inode(kubelet) != kubeletInode || inode(socket) != pluginInode {
			log.Printf("kubelet socket changed; registering again")
			return nil
		}
	}
}

func main() {
	dir := flag.String("socket-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name to advertise")
	count := flag.Int("count", 8, "number of devices to advertise")
	prefix := flag.String("device-prefix", "GPU-fake", "device IDs are <prefix>-<index>")
	health := flag.String("health-addr", "", "host:port for GET /healthz (200 while registered)")
	allocations := flag.String("allocations", os.DevNull, "file that gets one line per Allocate")
	flag.Parse()
	out, err := os.OpenFile(*allocations, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		log.Fatal(err)
	}
	p := &plugin{allocations: out}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("%s-%d", *prefix, i), Health: pluginapi.Healthy})
	}
	var registered atomic.Bool
	if *health != "" {
		go func() {
			log.Fatal(http.ListenAndServe(*health, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/healthz" && registered.Load() {
					w.WriteHeader(http.StatusOK)
				} else {
					w.WriteHeader(http.StatusServiceUnavailable)
				}
			})))
		}()
	}
	endpoint := strings.ReplaceAll(*resource, "/", "-") + ".sock"
	for {
		if err := serve(p, *dir, endpoint, *resource, &registered); err != nil {
			log.Printf("%v; retrying", err)
			time.Sleep(time.Second)
		}
	}
}
