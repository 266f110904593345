// A placement-rule plugin. It pins pods to the zone named by the KVCache
// annotation `example.com/zone`, if present; add your own rules in `place`.
//
// How WIT looks from JavaScript here: `place(request)` gets the
// `pod-request` record (`annotations` is an array of [name, value] pairs)
// and answers the `placement` record with camelCased fields; an absent
// `option` is `undefined`, enum cases are strings ('in', 'not-in', ...).

const ZONE = /^[A-Za-z0-9-]{1,63}$/;

export const scheduling = {
  configure(config) {
    return { tag: 'ok', val: undefined };
  },

  place(request) {
    const zone = new Map(request.annotations).get('example.com/zone');
    let nodeAffinity;
    if (zone !== undefined) {
      if (!ZONE.test(zone)) {
        return { tag: 'err', val: { tag: 'invalid', val: `annotation example.com/zone=${JSON.stringify(zone)}: not a valid zone name` } };
      }
      const requirement = { key: 'topology.kubernetes.io/zone', operator: 'in', values: [zone] };
      nodeAffinity = { required: [[requirement]], preferred: [] };
    }
    return {
      tag: 'ok',
      val: { nodeAffinity, podAffinity: undefined, podAntiAffinity: undefined, tolerations: [], topologySpread: [] },
    };
  },
};
