package transfer

import (
	"context"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
)

// TestPushToADownRegistrySaysSo pushes to an address nothing listens on:
// the error says the registry cannot be reached, and does not call the tag
// looked up for a base "base TAG" as if the user had named one.
func TestPushToADownRegistrySaysSo(t *testing.T) {
	img := testenv.ImageDir(t, synth.HalfZero, 1<<20, 1)
	c, err := NewClient(ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	repo, tag, err := c.Repository(testenv.FreeAddr(t) + "/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []format.Version{format.V1, format.V2} {
		_, err = Push(context.Background(), img, repo, tag, PushOptions{Pack: format.PackOptions{Format: f}})
		if err == nil {
			t.Fatalf("%s push to an address nothing listens on succeeded", f)
		}
		msg := err.Error()
		if !strings.Contains(msg, "cannot reach the registry") || strings.HasPrefix(msg, "base ") {
			t.Errorf("%s push to a down registry failed with %q, want a line saying the registry cannot be reached and no \"base\" prefix", f, msg)
		}
	}
}
